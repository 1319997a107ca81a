"""Smoke test of benchmarks/algorithms.py: rows run from a given model and the table prints; its arguments."""

from __future__ import annotations

from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "algorithms.py"


def test_arguments_choose_rows_steps_and_overrides() -> None:
    from benchmarks.algorithms import parse_args

    assert [parse_args(argv).steps for argv in ([], ["--quick"], ["--steps", "5"])] == [80, 2, 5]
    args = parse_args(["--variants", "DAPO", "GSPO", "--lora", "--", "grpo.seed=3"])
    assert (args.variants, args.lora, args.overrides) == (["DAPO", "GSPO"], True, ["grpo.seed=3"])
    with pytest.raises(SystemExit):
        parse_args(["--variants", "PPO"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_table_runs_each_requested_row(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.algorithms import main

    main([
        "--quick", "--steps", "1", "--model", str(tiny_model_dir),
        "--out", str(tmp_path), "--variants", "DAPO", "GRPO+LoRA",
    ])  # fmt: skip
    stdout = capsys.readouterr().out
    rows = {line.split("|")[1].strip() for line in stdout.splitlines() if line.startswith("| ")}
    assert {"DAPO", "GRPO+LoRA"} <= rows
    assert "steps filled" in stdout  # the DAPO row says how dynamic sampling went
