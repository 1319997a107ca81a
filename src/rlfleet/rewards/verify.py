"""Symbolic answer checking with HF math-verify, and a wall-clock budget for any check.

math-verify bounds its own work with ``signal.alarm`` (whole seconds, re-armed and then cancelled around
every parse and every comparison), which would cancel an outer timer; we switch those off and bound a whole
check with one ``setitimer`` budget instead (:func:`time_budget`). A signal only interrupts Python code, so
this budget is best effort: a stall inside C code (a huge integer power, a regex) is bounded only by
:class:`rlfleet.rewards.pool.VerifierPool`, which kills the worker process.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

_CONFIGS = (LatexExtractionConfig(), ExprExtractionConfig())


class VerificationTimeout(BaseException):  # noqa: N818 -- reads better at the raise site than ...Error
    """A check ran past its :func:`time_budget`.

    A ``BaseException`` so that the ``except Exception`` blocks inside math-verify and sympy let it through.
    """


def _drop_timeout_disabled_warning(record: logging.LogRecord) -> bool:
    # We pass parsing_timeout=None / timeout_seconds=None on purpose (see the module docstring).
    return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_drop_timeout_disabled_warning)


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    del signum, frame
    raise VerificationTimeout("verification ran past its time budget")


def _can_arm() -> bool:
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0.0
    )


@contextmanager
def time_budget(seconds: float | None) -> Iterator[bool]:
    """Raises :class:`VerificationTimeout` inside the block once ``seconds`` of wall-clock time have passed.

    Yields whether the budget is armed. It is not (and the block runs unbounded) when ``seconds`` is None
    or not positive, off the main thread (signals are delivered to the main thread only), or when an
    interval timer is already running (an enclosing budget, e.g. a :class:`VerifierPool` worker's, wins).
    """
    if seconds is None or seconds <= 0 or not _can_arm():
        yield False
        return
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield True
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
        finally:  # the alarm may fire just before it is disarmed: restore the handler regardless
            signal.signal(signal.SIGALRM, previous)


def parse_gold(gold: str) -> list[object]:
    """math-verify's parse of a reference answer written as LaTeX or a plain expression."""
    return parse(f"${gold}$", _CONFIGS, parsing_timeout=None, raise_on_error=False)


def symbolic_match(prediction: str, gold: str) -> bool:
    """Whether the answer text ``prediction`` equals ``gold`` by math-verify (numerically or symbolically).

    Args:
        prediction: The final-answer text: the content of a ``\\boxed{}`` wrapped back into one, or a line
            of LaTeX or plain math (``\\frac{3}{4}``, ``3/4``, ``$0.75$``).
        gold: The reference answer (``"0.75"``, ``"\\frac{3}{4}"``).
    """
    predicted = parse(prediction, _CONFIGS, parsing_timeout=None, raise_on_error=False)
    if not predicted:
        return False
    wanted = parse_gold(gold)
    return bool(wanted) and verify(wanted, predicted, timeout_seconds=None, raise_on_error=False)
