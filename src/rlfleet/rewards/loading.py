"""The reward-function type and loading one by dotted path (``env.math.reward_fn``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from rlfleet.errors import UserError

RewardFn = Callable[[str, str, str], float]
"""``(prompt, response, gold) -> reward``; a top-level function so that worker processes can import it."""


class RewardFnError(UserError, ValueError):
    """``env.math.reward_fn`` does not name an importable function: the user's to fix (exit code 2)."""


def load_reward_fn(dotted_path: str) -> RewardFn:
    """Imports ``package.module.function`` and checks it is callable.

    Raises:
        RewardFnError: (a ``ValueError``) the path has no module part, cannot be imported, or does not name
            a callable.
    """
    module_name, _, attr = dotted_path.rpartition(".")
    if not module_name:
        raise RewardFnError(
            f"env.math.reward_fn: reward function {dotted_path!r} is not a dotted path like "
            "'rlfleet.rewards.math_reward'"
        )
    try:
        fn: RewardFn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise RewardFnError(
            f"env.math.reward_fn: cannot import reward function {dotted_path!r}: {exc}; fix: the dotted path "
            "of a top-level function in a module importable here (and by the reward worker processes)"
        ) from exc
    if not callable(fn):
        raise RewardFnError(f"env.math.reward_fn: reward function {dotted_path!r} is not callable")
    return fn
