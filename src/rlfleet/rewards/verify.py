"""Symbolic answer checking with HF math-verify, and a wall-clock budget for any check.

math-verify bounds its own work with ``signal.alarm`` (whole seconds, re-armed and then cancelled around
every parse and every comparison), which would cancel an outer timer; we switch those off and bound a whole
check with one ``setitimer`` budget instead (:func:`time_budget`). A signal only interrupts Python code, so
this budget is best effort: a stall inside C code (a huge integer power, a regex) is bounded only by
:class:`rlfleet.pools.process_pool.ProcessWorkerPool`, which kills the worker process.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

_CONFIGS = (LatexExtractionConfig(), ExprExtractionConfig())


class VerificationTimeout(BaseException):
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


_active = False  # one of our budgets is armed in this process: inner ones defer to it


def _usable() -> bool:
    return (
        hasattr(signal, "setitimer") and not _active and threading.current_thread() is threading.main_thread()
    )


@contextmanager
def time_budget(seconds: float | None) -> Iterator[bool]:
    """Raises :class:`VerificationTimeout` inside the block once ``seconds`` of wall-clock time have passed.

    Yields whether the budget is armed. It is not (and the block runs unbounded by it) when ``seconds`` is
    None or not positive, off the main thread (signals reach the main thread only), inside another
    ``time_budget`` (the outer one owns the time, e.g. a pool worker's), or when a foreign
    interval timer (pytest-timeout) fires first anyway. A later foreign timer is suspended meanwhile and
    re-armed with its remaining time.
    """
    global _active
    outer = signal.getitimer(signal.ITIMER_REAL)[0] if _usable() else 0.0
    if seconds is None or seconds <= 0 or not _usable() or 0.0 < outer <= seconds:
        yield False
        return
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    _active = True
    try:
        yield True
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
        finally:  # the alarm may fire just before it is disarmed: restore the rest regardless
            _active = False
            signal.signal(signal.SIGALRM, previous)
            if outer:
                signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))


def parse_gold(gold: str) -> list[object]:
    """math-verify's parse of a reference answer written as LaTeX or a plain expression."""
    parsed: list[object] = parse(f"${gold}$", _CONFIGS, parsing_timeout=None, raise_on_error=False)
    return parsed


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
