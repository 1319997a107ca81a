"""Smoke test of benchmarks/environments.py: every stage runs in quick mode and the table prints; its
arguments."""

from __future__ import annotations

from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "environments.py"


def test_arguments_name_the_output_folder_and_the_grpo_overrides() -> None:
    from benchmarks.environments import parse_args

    default = parse_args([])
    assert (default.out, default.quick, default.sft_steps, default.grpo) == (
        Path("runs/bench_environments"), False, None, []
    )  # fmt: skip
    args = parse_args(
        ["--quick", "--out", "x", "--sft-steps", "3", "--grpo", "grpo.seed=3", "grpo.val_period=1"]
    )
    assert (args.out, args.quick, args.sft_steps) == (Path("x"), True, 3)
    assert args.grpo == ["grpo.seed=3", "grpo.val_period=1"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_quick_environment_benchmark_prints_its_three_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.environments import main

    main(["--quick", "--out", str(tmp_path)])
    stdout = capsys.readouterr().out
    rows = [line.split("  ")[0] for line in stdout.splitlines()]
    assert {"no tool, SFT", "tool, SFT", "tool, SFT + GRPO"} <= {r.strip() for r in rows}
    assert "GRPO validation curve" in stdout
