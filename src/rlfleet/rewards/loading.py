"""The reward-function type and loading one by dotted path (``env.math.reward_fn``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

RewardFn = Callable[[str, str, str], float]
"""``(prompt, response, gold) -> reward``; a top-level function so that worker processes can import it."""


def load_reward_fn(dotted_path: str) -> RewardFn:
    """Imports ``package.module.function`` and checks it is callable.

    Raises:
        ValueError: The path has no module part, cannot be imported, or does not name a callable.
    """
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
