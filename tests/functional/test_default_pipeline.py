"""The embedded default (SFT warm start, then GRPO) at reduced size: GRPO must raise accuracy and reward."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.demo import run_demo
from rlfleet.logging import read_metrics

QUIET = ["logger.tensorboard_enabled=false", "logger.progress_bar=false"]


@pytest.mark.slow
def test_default_pipeline_at_reduced_size_raises_reward(tmp_path: Path, capsys) -> None:
    result = run_demo(
        tmp_path,
        overrides=[*QUIET, "grpo.max_num_steps=20", "grpo.val_period=20", "grpo.max_val_samples=64"],
        sft_overrides=[*QUIET, "sft.val_period=0", "sft.val_at_start=false", "sft.max_val_samples=64"],
    )
    out = capsys.readouterr().out
    assert "after SFT" in out and "plot:" in out
    before, after = result["val_accuracy_before"], result["val_accuracy_after"]
    assert before > 0.2, "the SFT warm start should give a non-zero starting accuracy"
    assert after >= before + 0.05, f"GRPO did not raise validation accuracy: {before:.3f} -> {after:.3f}"
    rewards = [r["train/reward"] for r in read_metrics(tmp_path / "grpo" / "logs") if "train/reward" in r]
    assert len(rewards) == 20
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5
    assert (tmp_path / "grpo" / "logs" / "plot.png").is_file()
    assert (tmp_path / "sft_model" / "config.json").is_file()

    # Rerunning the finished pipeline does no training and reports the same numbers.
    again = run_demo(
        tmp_path,
        overrides=[*QUIET, "grpo.max_num_steps=20", "grpo.val_period=20", "grpo.max_val_samples=64"],
        sft_overrides=[*QUIET, "sft.val_period=0", "sft.val_at_start=false", "sft.max_val_samples=64"],
    )
    assert again == result
