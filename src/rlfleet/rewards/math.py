"""Answer extraction and the binary math reward.

A reward function is a plain function ``(prompt, response, gold) -> float``; recipes pick one by dotted
path (``env.math.reward_fn``).
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_HASHES = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_BOXED = re.compile(r"\\boxed\{\s*\$?\s*(" + _NUMBER + r")\s*\}")
_ANY = re.compile(_NUMBER)
_MAX_CHARS = 10_000


def _clean(number: str) -> str:
    return number.replace(",", "").rstrip(".")


def extract_answer(text: str) -> str | None:
    """The final answer in ``text``: the number after ``####``, else in ``\\boxed{}``, else the last number.

    Thousands separators are removed (``1,080`` -> ``1080``). Returns None when ``text`` has no number.
    Only the last ``10,000`` characters are searched, so a huge response costs bounded time.
    """
    tail = text[-_MAX_CHARS:]
    for pattern in (_HASHES, _BOXED):
        found = pattern.findall(tail)
        if found:
            return _clean(found[-1])
    numbers = _ANY.findall(tail)
    return _clean(numbers[-1]) if numbers else None


def _as_number(text: str) -> Fraction | None:
    try:
        return Fraction(_clean(text.strip().lstrip("$")))
    except (ValueError, ZeroDivisionError):
        return None


def math_reward(prompt: str, response: str, gold: str) -> float:
    """1.0 when the response's final answer equals ``gold`` numerically, else 0.0.

    Args:
        prompt: The prompt (unused by this reward; part of the reward-function signature).
        response: The model's generated text.
        gold: The reference answer, a number such as ``"72"`` or ``"1,080"``.
    """
    del prompt
    predicted = extract_answer(response)
    if predicted is None:
        return 0.0
    want, got = _as_number(gold), _as_number(predicted)
    return 1.0 if want is not None and got is not None and want == got else 0.0
