"""Smoke test of benchmarks/distillation.py: its arguments, the time-to-accuracy arithmetic and the tables,
and one quick row from a given student and teacher."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmarks.distillation import KL_TYPES, TASKS, format_tables, main, parse_args, seconds_to
from benchmarks.preferences import Curve

from tests.functional.test_distillation import teacher_dir  # noqa: F401


def test_arguments_choose_the_kl_types_the_target_and_each_rows_overrides() -> None:
    args = parse_args([])
    assert (args.task, args.kl_types, args.target, args.student) == ("tiny", list(KL_TYPES), None, None)
    assert parse_args(["--task", "smollm2"]).task == "smollm2" and TASKS["smollm2"][2] == 0.25
    args = parse_args(["--kl-types", "mixed", "--target", "0.6", "--distill", "distillation.seed=3"])
    assert (args.kl_types, args.target, args.distill) == (["mixed"], 0.6, ["distillation.seed=3"])
    for bad in (["--kl-types", "jensen"], ["--task", "gsm8k"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_time_to_the_target_and_the_ratio_to_grpo() -> None:
    grpo = Curve("GRPO", [(0.0, 0.5), (40.0, 0.7), (80.0, 0.8)], steps=20)
    fast = Curve("distill/mixed", [(0.0, 0.5), (10.0, 0.76), (30.0, 0.8)], steps=10)
    slow = Curve("distill/forward", [(0.0, 0.5), (30.0, 0.7)], steps=10)
    assert (seconds_to(grpo, 0.75), seconds_to(fast, 0.75), seconds_to(slow, 0.75)) == (80.0, 10.0, None)
    table = format_tables(grpo, [(fast, 0.25), (slow, 0.3)], 0.75)
    assert "| distill/mixed | 50.0% | 80.0% | 30 | 10 | 10 s | 0.12x |" in table
    assert "| distill/forward | 50.0% | 70.0% | 30 | 10 | not reached |  |" in table
    assert "| distill/mixed | 25.0% |" in table


def test_quick_row_from_a_given_student_and_teacher(
    tiny_model_dir: Path,
    teacher_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["distillation.py", "--quick", "--kl-types", "mixed", "--out", str(tmp_path)]
    given = ["--student", str(tiny_model_dir), "--teacher", str(teacher_dir)]
    monkeypatch.setattr("sys.argv", [*argv, *given])
    main()
    out = capsys.readouterr().out
    assert "| distill/mixed |" in out and "teacher share of the step" in out
    assert "| GRPO |" not in out  # no GRPO row: the student and teacher were given
