"""Reward functions: plain ``(prompt, response, gold) -> float`` callables chosen by dotted path.

:func:`math_reward` checks a final answer (``#### N``, ``\\boxed{}``, a last number) against the gold, exactly
for plain numbers and with HF math-verify otherwise; a worked-solution gold is reduced to its answer first
(:func:`gold_answer`), and a gold that is no answer raises :class:`InvalidGoldError`, which the pools count
as an error. :class:`VerifierPool` runs any reward function over a batch in worker processes with a
per-response time bound (``rewards.ray_pool.RayVerifierPool`` in Ray actors; both are :class:`ScoringPool`).
"""

from __future__ import annotations

from rlfleet.answers import InvalidGoldError, extract_answer, extract_gold, gold_answer
from rlfleet.rewards.loading import RewardFn, load_reward_fn
from rlfleet.rewards.math import math_reward
from rlfleet.rewards.pool import RewardBatch, ScoringPool, VerifierPool

__all__ = [
    "InvalidGoldError",
    "RewardBatch",
    "RewardFn",
    "ScoringPool",
    "VerifierPool",
    "extract_answer",
    "extract_gold",
    "gold_answer",
    "load_reward_fn",
    "math_reward",
]
