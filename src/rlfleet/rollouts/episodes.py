"""Episodes, the one way rollouts are made: the model and its environments take turns, token in, token out.

A single-turn task is a one-turn episode: the ``math`` environment scores the first answer and ends the
episode (as NeMo RL runs math), so GRPO, validation and ``rlfleet eval`` share this path whatever the task.

Each turn, every running episode's context (its prompt, then every token so far) goes to the engine, which
samples the model's turn, stopping at EOS or at a stop string the environment asked for (``</tool_call>``);
the environment's :meth:`~rlfleet.environments.EnvironmentInterface.step` reads the turn and answers; the
answer (a ``tool`` or ``user`` message) is rendered with the chat template and its tokens appended. An episode
ends when its environment says so, at the job's ``max_rollout_turns``, or when its next turn would not fit in
``policy.max_total_sequence_length`` (the episode is then *cut*: flagged, counted and, like a response that
ran out of tokens, not ``finished``).

Token in, token out: the training sequence holds the exact ids the engine sampled for each model turn and
their logprobs, never a re-tokenisation of their text; observation tokens (and the end-of-turn tokens the
template adds after a turn that stopped at a stop string) are context, masked out of the loss
(:attr:`~rlfleet.rollouts.rollout.Rollout.mask`) and out of the response-length counts.

Seeds stay batch-invariant per turn: episode ``i`` of a call seeded ``s`` samples its first turn from
``row_seeds(s, n)[i]``, exactly the seed a single-turn rollout of the same row uses, and turn ``t`` from a
seed derived from that one and ``t``, whichever other episodes are still running.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlfleet.data import Prompt
from rlfleet.data.prompts import ObservationTemplate
from rlfleet.environments.agent import AgentEnvironment
from rlfleet.environments.interface import Message
from rlfleet.environments.runner import EnvRunner
from rlfleet.errors import UserError
from rlfleet.generation import GenerationBackend, GenerationResult, SamplingParams
from rlfleet.generation.sampling import row_seeds, turn_seed
from rlfleet.rollouts.agents import AgentDriver
from rlfleet.rollouts.conversation import Episode
from rlfleet.rollouts.rollout import Rollout


def initial_messages(prompt: Prompt, system_prompt: str | None) -> list[Message]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": prompt.example.question}]


def initial_metadata(prompt: Prompt) -> dict[str, Any]:
    """What an environment reads of a row: ``ground_truth`` (the gold) and the row's extra fields."""
    return {"ground_truth": prompt.example.gold, **dict(prompt.example.extra or {})}


@dataclass(frozen=True)
class EpisodeBatch:
    """A batch of finished episodes as rollouts, with what running them took."""

    rollouts: list[Rollout]
    num_timeouts: int
    num_errors: int
    metrics: dict[str, float]
    seconds: dict[str, float]


class EpisodeRunner:
    """Runs episodes with a generation backend and the recipe's environments.

    Args:
        backend: The engines (any backend: HF, vLLM, on Ray or not).
        tokenizer: The policy's tokenizer (its chat template renders observations).
        environments: Runner of each environment name; none at all for a run that rolls out nothing (a
            reward model's, whose backend is ``NoGeneration``).
        default_env: The environment of rows that name none.
        max_turns: The most model turns of an episode (the job's own ``max_rollout_turns``: ``grpo.``,
            ``sft.``, ``distillation.``, ``eval.``).
        max_seq_len: ``policy.max_total_sequence_length``.
        system_prompt: The system message the prompts were rendered with (the conversation's first message).
    """

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: PreTrainedTokenizerBase,
        environments: Mapping[str, EnvRunner],
        default_env: str,
        max_turns: int,
        max_seq_len: int,
        system_prompt: str | None = None,
    ) -> None:
        self.backend, self.environments, self.default_env = backend, dict(environments), default_env
        self.max_turns, self.max_seq_len, self.system_prompt = max_turns, max_seq_len, system_prompt
        self.template = ObservationTemplate(tokenizer)
        self.tokenizer = tokenizer
        self._drivers: dict[str, AgentDriver] = {}
        if self.environments and default_env not in self.environments:
            raise ValueError(f"default environment {default_env!r} is not one of {sorted(self.environments)}")

    def env_of(self, prompt: Prompt) -> str:
        return prompt.example.env or self.default_env

    def run(
        self, prompts: Sequence[Prompt], group_size: int, params: SamplingParams, seed: int
    ) -> EpisodeBatch:
        """``group_size`` episodes per prompt (contiguous); episode ``i`` is seeded from
        ``row_seeds(seed, n)[i]``."""
        repeated = [p for p in prompts for _ in range(group_size)]
        seeds = row_seeds(seed, len(repeated))
        episodes = []
        for prompt, episode_seed in zip(repeated, seeds, strict=True):
            env = self.env_of(prompt)
            if env not in self.environments:
                raise UserError(
                    f"a data row names environment {env!r}, which the recipe does not configure (env.{env})"
                )
            first_stops = self.environments[env].environment.stop_strings
            episodes.append(
                Episode(
                    prompt,
                    env,
                    episode_seed,
                    initial_messages(prompt, self.system_prompt),
                    initial_metadata(prompt),
                    tuple(first_stops or ()),
                )
            )
        seconds = {"generation": 0.0, "env": 0.0}
        problems = [0, 0]
        agent_metrics: dict[str, float] = {}
        for name, driver in self._agent_drivers(episodes).items():
            start = time.perf_counter()
            timeouts, errors, agent_metrics = driver.run([e for e in episodes if e.env == name], params)
            seconds["generation"] += time.perf_counter() - start
            problems[0] += timeouts
            problems[1] += errors
        for turn in range(self.max_turns):
            active = [e for e in episodes if not e.done]
            if not active:
                break
            start = time.perf_counter()
            self._generate(active, params, turn)
            seconds["generation"] += time.perf_counter() - start
            start = time.perf_counter()
            timeouts, errors = self._step(active, last_turn=turn == self.max_turns - 1)
            seconds["env"] += time.perf_counter() - start
            problems[0] += timeouts
            problems[1] += errors
        start = time.perf_counter()
        metrics = {**self._metrics(episodes), **agent_metrics}
        seconds["env"] += time.perf_counter() - start
        return EpisodeBatch([self._rollout(e) for e in episodes], problems[0], problems[1], metrics, seconds)

    def _agent_drivers(self, episodes: Sequence[Episode]) -> dict[str, AgentDriver]:
        """The drivers of the ``agent`` environments these episodes use, started on first use (their
        endpoint stops with the environment, when the run closes its runners)."""
        for name in {e.env for e in episodes} - set(self._drivers):
            environment = self.environments[name].environment
            if isinstance(environment, AgentEnvironment):
                self._drivers[name] = AgentDriver(environment, self.backend, self.tokenizer, self.max_seq_len)
        return {name: d for name, d in self._drivers.items() if any(e.env == name for e in episodes)}

    # ------------------------------------------------------------------------------------------- a turn

    def _generate(self, active: list[Episode], params: SamplingParams, turn: int) -> None:
        by_stops: dict[tuple[str, ...], list[Episode]] = defaultdict(list)
        for episode in active:
            by_stops[episode.stop_strings].append(episode)
        for stops, group in by_stops.items():
            room = [self.max_seq_len - e.length for e in group]
            call = replace(
                params, max_new_tokens=max(1, min(params.max_new_tokens, max(room))), stop_strings=stops
            )
            results = self.backend.generate_rows(
                [e.context() for e in group], call, [turn_seed(e.seed, turn) for e in group]
            )
            for episode, result, budget in zip(group, results, room, strict=True):
                self._take_turn(episode, result, budget)

    def _take_turn(self, episode: Episode, result: GenerationResult, budget: int) -> None:
        ids, logprobs = result.token_ids[:budget], result.logprobs[:budget]
        if len(result.token_ids) > budget or (len(ids) == budget and not result.finished):
            episode.cut = True  # the sequence budget ended this turn
        episode.append(ids, logprobs)
        episode.last_turn_finished = result.finished and len(ids) == len(result.token_ids)
        text = result.text if len(ids) == len(result.token_ids) else self._decode(ids, skip_special=True)
        episode.messages.append({"role": "assistant", "content": text})
        episode.turns += 1

    def _step(self, active: list[Episode], last_turn: bool) -> tuple[int, int]:
        by_env: dict[str, list[Episode]] = defaultdict(list)
        for episode in active:
            by_env[episode.env].append(episode)
        timeouts = errors = 0
        eos = self.tokenizer.eos_token_id
        for name, group in by_env.items():
            report = self.environments[name].step([e.messages for e in group], [e.metadata for e in group])
            timeouts += report.num_timeouts
            errors += report.num_errors
            for episode, outcome in zip(group, report.outcomes, strict=True):
                if outcome is None:  # the environment failed on this item: it costs the item
                    episode.reward, episode.done, episode.failed = 0.0, True, True
                    continue
                episode.reward += outcome.reward
                episode.metadata = outcome.metadata
                if outcome.terminated or episode.cut or last_turn:
                    episode.done = True
                    continue
                ended_with_eos = bool(episode.token_ids) and episode.token_ids[-1] == eos
                observation = self.template.ids(outcome.observation, ended_with_eos)
                if episode.length + len(observation) >= self.max_seq_len:  # no room for another turn
                    episode.done = episode.cut = True
                    continue
                episode.append(observation, None)
                episode.messages.append(outcome.observation)
                episode.stop_strings = tuple(outcome.stop_strings or ())
        return timeouts, errors

    # ------------------------------------------------------------------------------------------ results

    def _rollout(self, episode: Episode) -> Rollout:
        """The episode as a rollout; a single-turn one's text is exactly its one response's (the engine's)."""
        single_turn = episode.turns == 1  # no observation follows a last turn
        text = (
            episode.messages[-1]["content"]
            if single_turn
            else self._decode(episode.token_ids, skip_special=False)
        )
        result = GenerationResult(
            token_ids=tuple(episode.token_ids),
            logprobs=tuple(episode.logprobs),
            text=text,
            finished=not episode.cut and episode.last_turn_finished,  # truncated: cut, or out of tokens
        )
        info = {
            "turns": float(episode.turns),
            "cut": float(episode.cut),
            "env_failed": float(episode.failed),
            **{k: float(v) for k, v in _counters(episode.metadata).items()},
        }
        return Rollout(
            episode.prompt,
            result,
            episode.reward,
            mask=tuple(episode.mask),
            conversation=tuple(episode.messages),
            info=info,
        )

    def _decode(self, ids: Sequence[int], skip_special: bool) -> str:
        text = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)
        assert isinstance(text, str)  # one sequence decodes to one string
        return text

    def _metrics(self, episodes: list[Episode]) -> dict[str, float]:
        n = max(len(episodes), 1)
        metrics = {
            "turns_per_episode": sum(e.turns for e in episodes) / n,
            "episodes_cut": sum(e.cut for e in episodes) / n,
            "tool_calls_per_episode": sum(_counters(e.metadata).get("tool_calls", 0) for e in episodes) / n,
            "tool_errors_per_episode": sum(_counters(e.metadata).get("tool_errors", 0) for e in episodes) / n,
        }
        by_env: dict[str, list[Episode]] = defaultdict(list)
        for episode in episodes:
            by_env[episode.env].append(episode)
        for name, group in by_env.items():
            batch = {
                "message_log": [e.messages for e in group],
                "metadata": [e.metadata for e in group],
                "rewards": [e.reward for e in group],
            }
            try:
                _, extra = self.environments[name].environment.global_post_process_and_metrics(batch)
            except Exception as exc:
                raise UserError(
                    f"environment {name}: global_post_process_and_metrics raised {exc!r}"
                ) from exc
            metrics.update({f"env/{name}/{key}": float(value) for key, value in extra.items()})
        return metrics


def _counters(metadata: Any) -> dict[str, float]:
    """The tool counters an environment keeps in an episode's metadata (``tool_calls``, ``tool_errors``)."""
    if not isinstance(metadata, Mapping):
        return {}
    return {
        k: float(metadata[k])
        for k in ("tool_calls", "tool_errors")
        if isinstance(metadata.get(k), (int, float))
    }
