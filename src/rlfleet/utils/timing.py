"""Wall-clock timing of the phases of a step."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimer:
    """Accumulates seconds per named phase: ``with timer("generation"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``timing/<phase>`` for every phase plus ``timing/total`` since construction."""
        out = {f"timing/{k}": v for k, v in self.seconds.items()}
        out["timing/total"] = time.perf_counter() - self._start
        return out
