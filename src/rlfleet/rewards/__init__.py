"""Reward functions: plain ``(prompt, response, gold) -> float`` callables chosen by dotted path.

:func:`math_reward` checks a final answer (``#### N``, ``\\boxed{}``, a last number) against the gold, exactly
for plain numbers and with HF math-verify otherwise; a worked-solution gold is reduced to its answer first
(:func:`gold_answer`), and a gold that is no answer raises :class:`InvalidGoldError`, which the pools count
as an error. The pools of :mod:`rlfleet.pools` run a reward function over a batch in worker processes (or
Ray actors), each response within a time bound.
"""

from __future__ import annotations

from rlfleet.answers import InvalidGoldError, extract_answer, extract_gold, gold_answer
from rlfleet.rewards.loading import RewardFn, load_reward_fn
from rlfleet.rewards.math import math_reward

__all__ = [
    "InvalidGoldError",
    "RewardFn",
    "extract_answer",
    "extract_gold",
    "gold_answer",
    "load_reward_fn",
    "math_reward",
]
