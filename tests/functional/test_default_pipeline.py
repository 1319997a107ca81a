"""The embedded default job as `make train` runs it (`rlfleet demo`: SFT warm start, then GRPO) at reduced
size, from the command line: GRPO must raise accuracy and reward, the output names what the run wrote, and
the same command again trains nothing and prints the same numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlfleet.checkpoint import verify_checkpoint
from rlfleet.logging import read_metrics
from tests.conftest import cli_argv, run_cli_process

REDUCED = [
    "logger.tensorboard_enabled=false",
    "logger.progress_bar=false",
    # the SFT stage (the demo routes the sft section there): the recipe's 400 steps, no validation
    "sft.val_period=0",
    "sft.val_at_start=false",
    "sft.max_val_samples=64",
    # the GRPO stage: 20 of the recipe's 80 steps, validated before and after
    "grpo.max_num_steps=20",
    "grpo.val_period=20",
    "grpo.max_val_samples=64",
]


@pytest.mark.slow
def test_default_pipeline_from_the_command_line_raises_reward(tmp_path: Path) -> None:
    argv = cli_argv("demo", "--out", str(tmp_path), *REDUCED)
    result = run_cli_process(argv)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr

    sft = read_metrics(tmp_path / "sft" / "logs")
    assert [r["step"] for r in sft] == list(range(1, 401))
    assert (tmp_path / "base_model" / "config.json").is_file()
    assert (tmp_path / "sft_model" / "config.json").is_file()
    grpo = read_metrics(tmp_path / "grpo" / "logs")
    assert [r["step"] for r in grpo] == list(range(21))
    assert verify_checkpoint(tmp_path / "grpo" / "checkpoints" / "step_20")
    assert (tmp_path / "grpo" / "logs" / "plot.png").stat().st_size > 0

    before, after = grpo[0]["val/accuracy"], grpo[-1]["val/accuracy"]
    assert before > 0.2, "the SFT warm start should give a non-zero starting accuracy"
    assert after >= before + 0.05, f"GRPO did not raise validation accuracy: {before:.3f} -> {after:.3f}"
    rewards = [r["train/reward"] for r in grpo if "train/reward" in r]
    assert len(rewards) == 20
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5

    out = result.stdout
    assert "== stage 1/2" in out and "== stage 2/2" in out and "== done" in out
    match = re.search(r"([\d.]+)% after SFT -> ([\d.]+)% after GRPO", out)
    assert match, out[-2000:]
    assert [float(x) / 100 for x in match.groups()] == pytest.approx([before, after], abs=1e-3)
    assert f"metrics:     {tmp_path / 'grpo' / 'logs' / 'metrics.jsonl'}" in out
    assert f"plot:        {tmp_path / 'grpo' / 'logs' / 'plot.png'}" in out
    assert f"curve:       {tmp_path / 'plot.png'} (validation accuracy through SFT and GRPO)" in out
    assert (tmp_path / "plot.png").stat().st_size > 0 and (tmp_path / "sft" / "logs" / "plot.png").is_file()

    # The same command again: both stages are complete, nothing is trained, the numbers are the same.
    again = run_cli_process(argv)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("already complete") == 2
    assert read_metrics(tmp_path / "grpo" / "logs") == grpo and read_metrics(tmp_path / "sft" / "logs") == sft
    assert match.group(0) in again.stdout
