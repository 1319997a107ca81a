"""Smoke test of benchmarks/time_to_accuracy.py: both frameworks train the tiny case on their clocks, every
snapshot is scored by the one evaluator, and the table, the comparison line and the plot come out; and its
arguments.

Needs TRL: the ``bench`` extra, which ``dev`` includes (``make test`` installs it), so it never skips.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_quick_shrinks_the_case_and_a_micro_batch_must_divide_the_rows() -> None:
    from benchmarks.time_to_accuracy import parse_args

    quick = parse_args(["--quick"])
    assert (quick.budget_min, quick.marks, quick.prompts, quick.samples) == (0.02, "0,0.01,0.02", 2, 2)
    assert (quick.max_new_tokens, quick.val_prompts, quick.trl_micro_batch) == (8, 4, 0)
    full = parse_args([])
    assert (full.budget_min, full.prompts, full.samples, full.trl_micro_batch) == (20.0, 8, 8, 16)
    with pytest.raises(SystemExit):
        parse_args(["--prompts", "3", "--samples", "3"])  # 9 rows, micro-batches of 16


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_quick_time_to_accuracy_scores_both_sides_at_every_mark(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The script's parent here (it prepares the model and scores); each side trains in a child process of
    its own, as in every run (``run_side``)."""
    from benchmarks.time_to_accuracy import main

    main(["--quick", "--out", str(tmp_path)])
    stdout = capsys.readouterr().out
    scores = json.loads((tmp_path / "time_to_accuracy.json").read_text())
    assert set(scores) == {"rlfleet", "trl"}
    for name, curve in scores.items():
        assert set(curve) == {"0.0", "0.6", "1.2"}, name  # every mark (seconds) has a snapshot, scored
        assert all(0.0 <= acc <= 1.0 for acc in curve.values())
    assert scores["rlfleet"]["0.0"] == scores["trl"]["0.0"]  # the same model, the same evaluator
    assert "| minutes | rlfleet accuracy | rlfleet steps | trl accuracy | trl steps |" in stdout
    assert "TRL's final accuracy" in stdout
    assert (tmp_path / "time_to_accuracy.png").stat().st_size > 0
