"""A rollout (one scored episode: a prompt, the tokens after it and the reward) and the statistics the loops
report over a batch of them.

Rollouts come from :class:`~rlfleet.rollouts.episodes.EpisodeRunner`, the one path of GRPO, validation and
``rlfleet eval``: a single-turn row is a one-turn episode of the ``math`` environment. Whether a response is
correct is decided by :func:`rlfleet.rewards.correctness.is_correct` alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rlfleet.data import Prompt
from rlfleet.generation import GenerationResult
from rlfleet.rewards.correctness import is_correct


@dataclass(frozen=True)
class Rollout:
    """One sampled response to one prompt (or one multi-turn episode), with its reward.

    Attributes:
        prompt: The prompt.
        result: The tokens after the prompt and their logprobs (an episode's: every turn and observation).
        reward: The reward (an episode's return).
        mask: 1 on the tokens the model sampled, 0 on observation tokens; None: every token is sampled.
        conversation: The episode's messages, turn by turn (None where a rollout was made by hand).
        info: An episode's counters (``turns``, ``cut``, ``tool_calls``...).
    """

    prompt: Prompt
    result: GenerationResult
    reward: float
    mask: tuple[int, ...] | None = None
    conversation: tuple[dict[str, str], ...] | None = None
    info: Mapping[str, float] | None = None

    @property
    def correct(self) -> bool:
        return is_correct(self.reward)

    @property
    def num_response_tokens(self) -> int:
        """Tokens the model generated (observation tokens excluded)."""
        return len(self.result.token_ids) if self.mask is None else sum(self.mask)

    def sample(self) -> dict[str, object]:
        """The record ``samples.jsonl`` keeps of this rollout (an episode's whole conversation)."""
        ex = self.prompt.example
        record: dict[str, object] = {
            "prompt": ex.question,
            "response": self.result.text,
            "gold": ex.gold,
            "reward": self.reward,
        }
        if self.conversation is not None:
            record["conversation"] = list(self.conversation)
            record.update(self.info or {})
        return record


def accuracy(rollouts: Sequence[Rollout]) -> float:
    """Fraction of the rollouts that are correct (0.0 for none)."""
    return sum(r.correct for r in rollouts) / max(len(rollouts), 1)


def mean_reward(rollouts: Sequence[Rollout]) -> float:
    return sum(r.reward for r in rollouts) / max(len(rollouts), 1)


def mean_response_length(rollouts: Sequence[Rollout]) -> float:
    """Mean response length in tokens (0.0 for none)."""
    return sum(r.num_response_tokens for r in rollouts) / max(len(rollouts), 1)


def correct_per_group(rollouts: Sequence[Rollout], group_size: int) -> list[int]:
    """Correct responses in each prompt's group of ``group_size`` contiguous rollouts."""
    if len(rollouts) % group_size:
        raise ValueError(f"{len(rollouts)} rollouts do not split into groups of {group_size}")
    return [sum(r.correct for r in rollouts[i : i + group_size]) for i in range(0, len(rollouts), group_size)]
