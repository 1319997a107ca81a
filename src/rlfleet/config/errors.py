"""The one exception type for user-facing config problems, and helpers that phrase its messages."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from rlfleet.errors import UserError


class ConfigError(ValueError, UserError):
    """A user-facing config problem.

    Each entry of ``problems`` is one self-contained line naming the dotted key, the offending value, the
    constraint and a fix; the message lists all of them (under ``header`` when given or when several).
    """

    def __init__(self, problems: str | Sequence[str], header: str | None = None) -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        if header is None and len(self.problems) > 1:
            header = f"{len(self.problems)} config problems:"
        lines = self.problems if header is None else [header, *(f"  - {p}" for p in self.problems)]
        super().__init__("\n".join(lines))


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def got(value: Any) -> str:
    """``got <value> (<type>)`` for error messages."""
    return f"got {short_repr(value)} ({type(value).__name__})"


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Return a new dict: ``override`` on top of ``base``; dicts merge recursively, other values replace."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged
