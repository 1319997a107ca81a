"""One conversation in progress: the state :mod:`rlfleet.rollouts.episodes` runs turn by turn and an agent
driver (:mod:`rlfleet.rollouts.agents`) fills in from an agent's requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.data import Prompt
from rlfleet.environments.interface import Message


@dataclass
class Episode:
    """One conversation in progress."""

    prompt: Prompt
    env: str
    seed: int
    messages: list[Message]
    metadata: Any
    stop_strings: tuple[str, ...]
    token_ids: list[int] = field(default_factory=list)  # after the prompt
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 on sampled tokens
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    cut: bool = False
    last_turn_finished: bool = True  # the latest turn ended at EOS or a stop string, not at max_new_tokens
    failed: bool = False

    @property
    def length(self) -> int:
        return len(self.prompt.token_ids) + len(self.token_ids)

    def context(self) -> list[int]:
        return [*self.prompt.token_ids, *self.token_ids]

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.mask.extend([1 if logprobs is not None else 0] * len(ids))
