"""The environment interface, NeMo RL's (``nemo_rl/environments/interfaces.py``), so their environments port.

An environment reads a batch of conversations (each an OpenAI-style message log, the model's latest turn last)
with its per-episode ``metadata``, and answers for each: the observation to append (a ``tool`` or ``user``
message), the metadata of the next turn, the stop strings of the model's next turn, this turn's reward,
whether the episode is over, and the answer it extracted (for logs). A single-turn task (math) terminates
every episode on its first step; a tool task answers tool calls until the model gives a final answer.

A user's environment is a subclass named by import path in the recipe
(``env.<name>.environment: my_pkg.envs:MyEnv``), constructed with the ``env.<name>.cfg`` dict.

Differences from NeMo RL, all additive: ``rewards`` may also be a plain list of floats; an environment may
set :attr:`EnvironmentInterface.stop_strings` for the model's first turn (NeMo RL reads those from the data)
and :attr:`EnvironmentInterface.tools` (schemas the chat template renders into the prompt); a class may
override :meth:`EnvironmentInterface.preflight` (checks without loading) and define ``close()``.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import torch

Message = dict[str, str]
"""``{"role": ..., "content": ...}``."""
MessageLog = list[Message]

MetadataT = TypeVar("MetadataT")


class EnvironmentReturn(NamedTuple, Generic[MetadataT]):
    """What :meth:`EnvironmentInterface.step` returns; every field is batched (one entry per episode).

    Attributes:
        observations: The message to append to each conversation (``{"role", "content"}``); ignored for an
            episode that terminates.
        metadata: Each episode's metadata for its next step.
        next_stop_strings: Stop strings of each episode's next model turn (None: EOS only).
        rewards: ``[B]`` this turn's rewards (a tensor or a list of floats); an episode's return is their sum.
        terminateds: ``[B]`` whether each episode ended this turn.
        answers: The answer each response gave (for logs), or None.
    """

    observations: list[Message]
    metadata: list[MetadataT]
    next_stop_strings: list[list[str] | None] | list[None]
    rewards: torch.Tensor | list[float]
    terminateds: torch.Tensor | list[bool]
    answers: list[str | None] | None


class EnvironmentInterface(abc.ABC, Generic[MetadataT]):
    """An environment (NeMo RL's interface). Subclasses take ``cfg`` (the recipe's ``env.<name>.cfg``)."""

    stop_strings: Sequence[str] | None = None
    """Stop strings of the model's first turn (later turns take ``next_stop_strings``); None: EOS only."""

    tools: Sequence[Mapping[str, Any]] | None = None
    """JSON schemas of the tools the model may call, rendered into its prompt by the chat template."""

    def __init__(self, cfg: Mapping[str, Any] | None = None) -> None:
        self.cfg = dict(cfg or {})

    @classmethod
    def preflight(cls, cfg: Mapping[str, Any]) -> None:
        """Raises what the constructor would raise for ``cfg``, before anything expensive starts.

        The default builds an instance and drops it. A class whose constructor loads a model overrides it
        with the checks that load none (``rlfleet validate``, and a run that builds the class elsewhere, in
        a Ray actor, call this)."""
        cls(cfg)

    @abc.abstractmethod
    def step(
        self, message_log_batch: list[MessageLog], metadata: list[MetadataT]
    ) -> EnvironmentReturn[MetadataT]:
        """One step of each episode of the batch: read the model's latest turn, answer it."""

    def global_post_process_and_metrics(
        self, batch: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], dict[str, float]]:
        """After a step's episodes are done: post-process the batch and return metrics (none by default).

        ``batch`` holds ``message_log`` (every conversation), ``metadata`` (each episode's last) and
        ``rewards`` (``[B]`` returns)."""
        return batch, {}


@dataclass(frozen=True)
class StepOutcome:
    """One episode's share of an :class:`EnvironmentReturn`, checked (what the rollout loop consumes)."""

    observation: Message
    metadata: Any
    stop_strings: tuple[str, ...] | None
    reward: float
    terminated: bool
    answer: str | None = None


class MalformedReturn(ValueError):
    """An environment returned something that is not an :class:`EnvironmentReturn` of the batch's size."""


def _column(value: Any, size: int, name: str) -> list[Any]:
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist()
    if value is None and name in ("answers", "next_stop_strings"):
        return [None] * size
    if not isinstance(value, (list, tuple)) or len(value) != size:
        got = f"{len(value)} entries" if isinstance(value, (list, tuple)) else type(value).__name__
        raise MalformedReturn(f"{name} must have one entry per episode ({size}), got {got}")
    return list(value)


def _observation(value: Any) -> Message:
    if not isinstance(value, Mapping) or not isinstance(value.get("role"), str):
        raise MalformedReturn(f"an observation must be a {{'role', 'content'}} dict, got {value!r:.80}")
    content = value.get("content", "")
    if not isinstance(content, str):
        raise MalformedReturn(f"an observation's content must be a string, got {type(content).__name__}")
    return {"role": value["role"], "content": content}


def _stops(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str) or not all(isinstance(s, str) and s for s in value):
        raise MalformedReturn(
            f"next_stop_strings must be None or a list of non-empty strings, got {value!r:.80}"
        )
    return tuple(value)


def _reward(value: Any) -> float:
    reward = float(value)
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise MalformedReturn(f"a reward must be a finite number, got {value!r}")
    return reward


def split_return(result: Any, size: int) -> list[StepOutcome]:
    """The per-episode outcomes of ``result``, checked.

    Raises:
        MalformedReturn: ``result`` is not an :class:`EnvironmentReturn` (or a 6-tuple in its order) whose
            fields each have ``size`` entries of the right types.
    """
    if not isinstance(result, tuple) or len(result) != len(EnvironmentReturn._fields):
        raise MalformedReturn(f"step must return an EnvironmentReturn, got {type(result).__name__}")
    observations, metadata, stops, rewards, terminateds, answers = (
        _column(value, size, name) for value, name in zip(result, EnvironmentReturn._fields, strict=True)
    )
    outcomes = []
    for i in range(size):
        answer = answers[i]
        try:
            reward = _reward(rewards[i])
        except (TypeError, ValueError) as exc:
            raise MalformedReturn(f"rewards[{i}]: {exc}") from exc
        outcomes.append(
            StepOutcome(
                observation=_observation(observations[i]),
                metadata=metadata[i],
                stop_strings=_stops(stops[i]),
                reward=reward,
                terminated=bool(terminateds[i]),
                answer=None if answer is None else str(answer),
            )
        )
    return outcomes
