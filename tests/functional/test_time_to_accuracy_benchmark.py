"""Smoke test of benchmarks/time_to_accuracy.py: both frameworks train the tiny case on their clocks, every
snapshot is scored by the one evaluator, and the table, the comparison line and the plot come out.

Needs TRL: the ``bench`` extra, which ``dev`` includes (``make test`` installs it), so it never skips.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "time_to_accuracy.py"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_quick_time_to_accuracy_scores_both_sides_at_every_mark(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=390,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    scores = json.loads((tmp_path / "time_to_accuracy.json").read_text())
    assert set(scores) == {"rlfleet", "trl"}
    for name, curve in scores.items():
        assert set(curve) == {"0.0", "3.0", "6.0"}, name  # every mark has a snapshot, scored
        assert all(0.0 <= acc <= 1.0 for acc in curve.values())
    assert scores["rlfleet"]["0.0"] == scores["trl"]["0.0"]  # the same model, the same evaluator
    assert "| minutes | rlfleet accuracy | rlfleet steps | trl accuracy | trl steps |" in done.stdout
    assert "TRL's final accuracy" in done.stdout
    assert (tmp_path / "time_to_accuracy.png").stat().st_size > 0
