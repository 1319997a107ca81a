"""Reward functions: plain ``(prompt, response, gold) -> float`` callables chosen by dotted path."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from rlfleet.rewards.math import extract_answer, math_reward

RewardFn = Callable[[str, str, str], float]

__all__ = ["RewardFn", "extract_answer", "load_reward_fn", "math_reward"]


def load_reward_fn(dotted_path: str) -> RewardFn:
    """Imports ``package.module.function`` and checks it is callable."""
    module_name, _, attr = dotted_path.rpartition(".")
    if not module_name:
        raise ValueError(
            f"reward function {dotted_path!r} is not a dotted path like 'rlfleet.rewards.math_reward'"
        )
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import reward function {dotted_path!r}: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"reward function {dotted_path!r} is not callable")
    return fn
