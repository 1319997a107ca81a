"""Measuring a policy on the validation prompts: the loops' validation and ``rlfleet eval``.

Both run episodes with :class:`~rlfleet.rollouts.episodes.EpisodeRunner` (the path training uses) and count
a response as correct by :func:`~rlfleet.rewards.correctness.is_correct`: validation reports
``val/accuracy`` (fraction correct) and ``val/reward`` (mean reward); ``rlfleet eval`` reports pass@1 and
pass@k (:func:`pass_at_k`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from math import comb
from typing import Any

from rlfleet.data import Prompt
from rlfleet.generation import SamplingParams
from rlfleet.rollouts.episodes import EpisodeRunner
from rlfleet.rollouts.rollout import accuracy, mean_response_length, mean_reward


@dataclass
class EvalResult:
    """Validation of one policy: one episode per prompt."""

    accuracy: float
    reward: float
    mean_response_length: float
    samples: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)  # the episodes' metrics (turns, tool calls...)

    def metrics(self, prefix: str = "val") -> dict[str, float]:
        return {
            f"{prefix}/accuracy": self.accuracy,
            f"{prefix}/reward": self.reward,
            f"{prefix}/mean_response_length": self.mean_response_length,
            **{f"{prefix}/{key}": value for key, value in self.extra.items()},
        }


def evaluate(
    episodes: EpisodeRunner,
    prompts: Sequence[Prompt],
    params: SamplingParams,
    seed: int,
    num_samples_to_keep: int = 4,
) -> EvalResult:
    """Runs one episode per prompt: fraction correct, mean reward, mean length and the episodes' metrics."""
    batch = episodes.run(prompts, 1, params, seed)
    rollouts = batch.rollouts
    return EvalResult(
        accuracy=accuracy(rollouts),
        reward=mean_reward(rollouts),
        mean_response_length=mean_response_length(rollouts),
        samples=[r.sample() for r in rollouts[:num_samples_to_keep]],
        extra=batch.metrics,
    )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)
