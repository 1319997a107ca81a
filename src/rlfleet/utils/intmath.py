"""Integer arithmetic shared by the config checks and the micro-batch planner."""

from __future__ import annotations

import math


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


def divisors_near(number: int, target: int, multiple_of: int = 1, count: int = 3) -> list[int]:
    """Up to ``count`` divisors of ``number`` nearest ``target``, preferring multiples of ``multiple_of``."""
    small = [d for d in range(1, math.isqrt(number) + 1) if number % d == 0]
    divisors = sorted({*small, *(number // d for d in small)})
    preferred = [d for d in divisors if d % multiple_of == 0] or divisors
    return sorted(sorted(preferred, key=lambda d: (abs(d - target), d))[:count])
