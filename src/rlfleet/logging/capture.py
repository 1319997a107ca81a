"""A quiet console: the terminal shows rlfleet's own lines, everything else goes to a log file.

A run on the fast path starts libraries that talk a lot: vLLM's engine and worker processes log their
start-up, Triton and torch print notices, libraries raise warnings. :class:`ConsoleCapture` points file
descriptors 1 and 2 (what every library and every child process writes to, Python or not) at
``<log_dir>/output.log`` and keeps duplicates of the terminal's descriptors for rlfleet's own output: the
``rlfleet`` logger, the step lines and progress bar (:func:`terminal`), and the results the CLI prints.
Python warnings become log records (``logging.captureWarnings``), so they land in the file too. ``rlfleet
--verbose`` skips all this and shows everything where it is printed.

While a capture is active :func:`terminal` returns the terminal's stream; otherwise ``sys.stdout`` /
``sys.stderr`` as they are (so output captured by a test harness stays captured).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from pathlib import Path
from types import TracebackType
from typing import Literal, TextIO

LOG_FILE = "output.log"

_terminal: dict[str, TextIO] = {}


def terminal(which: Literal["out", "err"] = "out") -> TextIO:
    """Where rlfleet's own output goes: the terminal while a :class:`ConsoleCapture` is active, else the
    current ``sys.stdout`` (``"out"``) or ``sys.stderr`` (``"err"``)."""
    stream = _terminal.get(which)
    if stream is not None:
        return stream
    return sys.stdout if which == "out" else sys.stderr


def _duplicate(stream: TextIO) -> TextIO | None:
    """A new stream on a duplicate of ``stream``'s descriptor (it keeps writing to the terminal after the
    descriptor is redirected); None when ``stream`` has no descriptor (a test harness's buffer: it is not
    redirected, so it can be used as it is)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None
    encoding = getattr(stream, "encoding", None) or "utf-8"
    return os.fdopen(os.dup(fd), "w", buffering=1, encoding=encoding, errors="replace")


class ConsoleCapture:
    """Sends descriptors 1 and 2 to ``log_dir/output.log`` for the duration of a ``with`` block.

    On exit both descriptors are restored (a traceback printed afterwards reaches the terminal). Child
    processes started inside the block (a vLLM engine) keep writing to the file until they end.
    """

    def __init__(self, log_dir: str | Path) -> None:
        self.path = Path(log_dir) / LOG_FILE
        self._saved: list[tuple[int, int]] = []
        self._handler: logging.Handler | None = None
        self._file: TextIO | None = None

    def __enter__(self) -> ConsoleCapture:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        out, err = _duplicate(sys.stdout), _duplicate(sys.stderr)
        _terminal["out"] = out or sys.stdout
        _terminal["err"] = err or sys.stderr
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._file = self.path.open("a", encoding="utf-8", buffering=1)
        for fd in (1, 2):
            self._saved.append((fd, os.dup(fd)))
            os.dup2(self._file.fileno(), fd)
        logging.captureWarnings(True)
        # rlfleet's records also reach the terminal; every record (rlfleet's included) reaches the file
        # through the root logger's handlers, which write to descriptors 1/2.
        self._handler = logging.StreamHandler(_terminal["err"])
        self._handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self._handler.addFilter(lambda record: record.levelno >= logging.INFO)
        logging.getLogger("rlfleet").addHandler(self._handler)
        # an INFO record, not an "rlfleet:" line: those are the one-line errors a failed run ends with
        logging.getLogger("rlfleet").info(
            "library output and warnings go to %s (--verbose shows them here)", self.path
        )
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        for fd, saved in reversed(self._saved):
            os.dup2(saved, fd)
            os.close(saved)
        self._saved.clear()
        if self._handler is not None:
            logging.getLogger("rlfleet").removeHandler(self._handler)
            self._handler = None
        logging.captureWarnings(False)
        for which in ("out", "err"):
            stream = _terminal.pop(which, None)
            if stream is not None and stream not in (sys.stdout, sys.stderr):
                stream.flush()
                stream.close()
        if self._file is not None:
            self._file.close()
            self._file = None
