"""Answers in text: the final answer of a response, and the gold answer of a reference solution.

A shared leaf: the data layer checks every row's gold when it loads a dataset
(:func:`gold_answer`), and the rewards score responses against it, so neither imports the other.

A gold must be an answer, not a worked solution: a gold holding ``####`` or a ``\\boxed{}`` is reduced to
that answer first (GSM8k's whole ``answer`` field works), and a gold that is still not an answer (empty,
several lines, over 100 characters) raises :class:`InvalidGoldError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_HASHES = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_BOXED = re.compile(r"\\boxed\{\s*\$?\s*(" + _NUMBER + r")\s*\}")
_ANY = re.compile(_NUMBER)
_HASHES_NUMBER = re.compile(r"\$?\s*(" + _NUMBER + r")(?!\s*/)")
# One number, alone: an optional currency sign, the number, an optional percent sign, then only words and
# punctuation (units, a full stop, markdown emphasis) -- no digit, operator or LaTeX that would make the
# number part of an expression.
_PLAIN = re.compile(r"\s*(?:\\?\$\s*)?(" + _NUMBER + r")\s*(?:\\?%)?[\sA-Za-z.,;:!?()'\"$*]*")
# Text right before a last number that makes it part of a fraction, power, subscript or LaTeX command.
_EXPRESSION_BEFORE = re.compile(r"(?:[/^_{]|\\[A-Za-z]*)\s*$")
_BOXED_OPEN = "\\boxed{"
_MAX_CHARS = 10_000
MAX_ANSWER_CHARS = 1_000
"""The longest final answer compared; a longer one is prose, not an answer."""
MAX_GOLD_CHARS = 100
"""The longest gold answer :func:`gold_answer` accepts; anything longer is prose, not an answer."""
_SHOWN_GOLD_CHARS = 80


class InvalidGoldError(ValueError):
    """A gold that is not an answer and cannot be reduced to one (see :func:`gold_answer`).

    A bug in the data (or the caller), not in the response: the verifier pools count it in ``num_errors``.
    """


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


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, nested braces included; None when absent or unclosed."""
    start = text.rfind(_BOXED_OPEN)
    if start < 0:
        return None
    start += len(_BOXED_OPEN)
    depth = 1
    for index in range(start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[start:index]
    return None


def extract_gold(output: str) -> str | None:
    """The final answer of a worked solution (a dataset's reference output), or None when it has none.

    The number after the last ``####`` with thousands commas removed (``#### 1,080`` -> ``1080``; a
    non-numeric answer there, such as ``3/4`` or ``B``, is kept as written), else the content of the last
    ``\\boxed{...}`` (braces matched), else None.
    """
    if "####" in output:
        tail = output.rpartition("####")[2].strip()
        line = tail.splitlines()[0].strip() if tail else ""
        number = _HASHES_NUMBER.match(line)
        gold = _clean(number.group(1)) if number else line
        if gold:
            return gold
    boxed = _last_boxed(output)
    if boxed is None or not boxed.strip():
        return None
    return boxed.strip()


def _shown(gold: str) -> str:
    """``gold`` for an error message: its repr, cut to its first ``_SHOWN_GOLD_CHARS`` characters."""
    if len(gold) <= _SHOWN_GOLD_CHARS:
        return repr(gold)
    return f"{gold[:_SHOWN_GOLD_CHARS]!r}..."


def _reduced(gold: str) -> str:
    """The answer of a gold holding ``####`` or ``\\boxed{``; ``gold`` stripped when it holds neither."""
    if "####" not in gold and _BOXED_OPEN not in gold:
        return gold.strip()
    answer = extract_gold(gold)
    if answer is None:
        raise InvalidGoldError(
            f"gold {_shown(gold)} has '####' or '\\boxed{{' but no answer after it; end the reference "
            "solution with '#### <answer>' or '\\boxed{<answer>}', or pass the answer itself as the gold"
        )
    return answer


def gold_answer(gold: str) -> str:
    """The answer to compare a response with: ``gold`` itself, or the final answer of the solution it is.

    A gold that holds ``####`` or ``\\boxed{`` is reduced with :func:`extract_gold` (GSM8k's worked
    solution ``"... #### 1,080"`` gives ``"1080"``); any other gold is only stripped. The result must then be
    an answer: not empty, one line, at most :data:`MAX_GOLD_CHARS` (100) characters -- a number (``"72"``), a
    short expression (``"3/4"``, ``"\\frac{3}{4}"``, ``"2^{10}"``) or a label (``"B"``). A short one-line
    sentence passes this check and is left to math-verify; a worked solution without a marker does not.

    Raises:
        InvalidGoldError: ``gold`` is empty, or a rationale with no ``####`` / ``\\boxed{}`` to reduce it to.
    """
    answer = _reduced(gold)
    problem = None
    if not answer:
        problem = "is empty"
    elif "\n" in answer or "\r" in answer:
        problem = "spans several lines"
    elif len(answer) > MAX_GOLD_CHARS:
        problem = f"is {len(answer):,} characters long (at most {MAX_GOLD_CHARS})"
    if problem is None:
        return answer
    reduced = "" if answer == gold.strip() else f" (reduced to {_shown(answer)})"
    raise InvalidGoldError(
        f"gold {_shown(gold)}{reduced} {problem}, so it is not an answer: pass the final answer "
        "(rlfleet.rewards.extract_gold(solution)), or a solution that ends with '#### <answer>' or "
        "'\\boxed{<answer>}'"
    )


@dataclass(frozen=True)
class FinalAnswer:
    """A response's final answer.

    Attributes:
        text: The answer as written (the line after ``####``, the boxed content, or the last number with
            the rest of its line).
        expression: What math-verify parses when ``text`` is not a plain number.
        standalone: False when the last number is part of an expression (``3/4``, ``2^{10}``) and must not
            be compared on its own.
    """

    text: str
    expression: str
    standalone: bool = True


def _last_number_answer(text: str) -> FinalAnswer | None:
    last = None
    for last in _ANY.finditer(text):  # noqa: B007 -- we want the last match
        pass
    if last is None:
        return None
    line_start = text.rfind("\n", 0, last.start()) + 1
    line_end = text.find("\n", last.end())
    line_end = len(text) if line_end < 0 else line_end
    standalone = _EXPRESSION_BEFORE.search(text, line_start, last.start()) is None
    line = text[line_start:line_end]
    return FinalAnswer(text[last.start() : line_end], line[-MAX_ANSWER_CHARS:], standalone)


def final_answer(response: str) -> FinalAnswer | None:
    """The final answer of ``response``: after the last ``####``, else the last ``\\boxed{}``, else the
    last number. Only the last 10,000 characters are read. None when there is none."""
    tail = response[-_MAX_CHARS:]
    if "####" in tail:
        after = tail.rpartition("####")[2].strip()
        line = after.splitlines()[0].strip() if after else ""
        if line:
            return FinalAnswer(line, line)
    boxed = _last_boxed(tail)
    if boxed is not None:
        return FinalAnswer(boxed, _BOXED_OPEN + boxed + "}")
    return _last_number_answer(tail)


def as_number(text: str) -> Fraction | None:
    """``text`` (a number, maybe with ``$`` and thousands commas) as an exact fraction, or None."""
    try:
        return Fraction(_clean(text.strip().lstrip("$").strip()))
    except (ValueError, ZeroDivisionError):
        return None


def plain_number(text: str) -> Fraction | None:
    """``text`` as an exact number when it is one number alone (``$1,080.``, ``75%``, ``18 eggs``)."""
    cleaned = text.replace("{,}", ",").replace("\\,", ",").replace("\\!", "")
    match = _PLAIN.fullmatch(cleaned)
    return as_number(match.group(1)) if match else None
