"""Smoke test of benchmarks/preferences.py: both rows run from a given model and the table prints; the
curve arithmetic (accuracy at a training time); its arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.preferences import Curve, curve, main, parse_args


def test_arguments_choose_the_task_and_each_rows_overrides() -> None:
    assert parse_args([]).task == "tiny"
    args = parse_args(["--task", "smollm2", "--quick", "--dpo", "dpo.seed=3", "--grpo", "grpo.seed=4"])
    assert (args.task, args.quick, args.dpo, args.grpo) == ("smollm2", True, ["dpo.seed=3"], ["grpo.seed=4"])
    with pytest.raises(SystemExit):
        parse_args(["--task", "gsm8k"])


def test_the_curve_sums_step_times_and_reads_accuracy_at_a_training_time(tmp_path: Path) -> None:
    records = [
        {"step": 0, "val/accuracy": 0.1, "timing/validation": 9.0},
        {"step": 1, "timing/total": 2.0},
        {"step": 2, "timing/total": 3.0, "val/accuracy": 0.4},
        {"step": 3, "timing/total": 4.0, "val/accuracy": 0.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    got = curve("GRPO", tmp_path)
    # synthetic step times, no clock: the curve's axis is the running sum of the records' timing/total
    # (validation time is not training time)
    step_times = [r["timing/total"] for r in records if "timing/total" in r]
    assert got == Curve("GRPO", [(0.0, 0.1), (sum(step_times[:2]), 0.4), (sum(step_times), 0.5)], steps=3)
    assert (got.at(4.9), got.at(5.0), got.at(100.0)) == (0.1, 0.4, 0.5)


@pytest.mark.slow
def test_quick_table_has_both_rows(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["preferences.py", "--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path)]
    dense = "env.math.reward_fn=tests.functional.rewards_for_tests.digit_fraction_reward"
    monkeypatch.setattr("sys.argv", [*argv, "--dpo", dense])
    main()
    rows = [
        line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| ")
    ]
    assert rows[1:] == ["GRPO", "DPO"]
