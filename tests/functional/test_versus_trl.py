"""Smoke test of benchmarks/versus_trl.py: both frameworks run the tiny case, like for like and each at its
best, and the table with the FLOP floors, both speed-ups and each phase against its own floors prints.

Needs TRL: the ``bench`` extra, which ``dev`` includes (``make test`` installs it), so it never skips.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "versus_trl.py"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_comparison_prints_both_frameworks_and_the_speed_up() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=230, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[1].strip() for line in done.stdout.splitlines() if line.startswith("| ")}
    assert {"rlfleet float32", "rlfleet best", "TRL float32", "TRL bf16"} <= rows
    assert "speed-up rlfleet / TRL, like for like (float32):" in done.stdout
    assert "speed-up rlfleet / TRL, best against best:" in done.stdout
    assert "FLOP floor s" in done.stdout
    cells = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")]
    by_phase = {(c[0].strip(), c[1].strip()): c for c in cells if len(c) == 7}
    for name in ("rlfleet best", "TRL bf16"):
        for phase in ("generation", "training"):
            assert (name, phase) in by_phase, f"no {phase} row for {name} in the by-phase table"
        assert by_phase[name, "generation"][5].strip(), "decoding's weight-read floor is missing"
