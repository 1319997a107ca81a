"""Integer arithmetic shared by the config checks and the micro-batch planner."""

from __future__ import annotations


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple
