"""Preemption, end to end: SIGKILL the training process between and during steps, start the same command
again, and end with the weights and metrics of an uninterrupted run (what a KubeRay retry does)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlfleet.checkpoint import CheckpointManager, load_model_state_dict
from rlfleet.config import ConfigError, MasterConfig, load_recipe, resolve_recipe_path
from rlfleet.logging import read_metrics
from rlfleet.runtime.loop import finished_run, run_metrics
from tests.conftest import comparable_metrics, run_cli_process, signal_when, small_grpo_overrides

DENSE = "env.math.reward_fn=tests.functional.rewards_for_tests.digit_fraction_reward"
# 8 training prompts at 4 per step: 2 steps per epoch; 2 epochs = 4 steps; checkpoints at 2 and 4.
EXTRA = [
    "data.arithmetic.num_train=8",
    "grpo.max_num_epochs=2",
    "grpo.max_num_steps=100",
    DENSE,
    "grpo.val_period=0",
    "grpo.val_at_start=false",
]


def command(model: Path, run: Path) -> list[str]:
    overrides = [*small_grpo_overrides(model, run), *EXTRA]
    return [sys.executable, "-m", "rlfleet.cli", "grpo", "grpo-tiny-arithmetic-cpu", *overrides]


def run_to_end(model: Path, run: Path) -> subprocess.CompletedProcess[str]:
    return run_cli_process(command(model, run))


def run_and_kill(model: Path, run: Path, after: Path, delay: float) -> None:
    """Starts the run, waits until ``after`` exists (+ ``delay`` s), then SIGKILLs it."""
    signal_when(command(model, run), after.exists, signal.SIGKILL, delay=delay)


def comparable(run: Path) -> list[dict]:
    return comparable_metrics(read_metrics(run / "logs"))


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("uninterrupted")
    result = run_to_end(tiny_model_dir, run)
    assert result.returncode == 0, result.stderr[-2000:]
    return run


def assert_same_as(reference: Path, run: Path) -> None:
    assert comparable(run) == comparable(reference)
    want = load_model_state_dict(reference / "ckpt" / "step_4")
    got = load_model_state_dict(run / "ckpt" / "step_4")
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.slow
def test_sigkill_in_a_step_then_rerun_matches_uninterrupted(
    reference: Path, tiny_model_dir: Path, tmp_path: Path
):
    """Killed 0.8 s into step 3 (generating or training: the step is lost, never half-saved)."""
    run_and_kill(tiny_model_dir, tmp_path, tmp_path / "ckpt" / "step_2" / "training_info.json", 0.8)
    result = run_to_end(tiny_model_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed from" in result.stderr
    assert_same_as(reference, tmp_path)


@pytest.mark.slow
def test_sigkill_between_steps_at_the_epoch_boundary_continues_into_the_next_epoch(
    reference: Path, tiny_model_dir: Path, tmp_path: Path
):
    """Killed as step 2's checkpoint lands (between steps, at the end of the first epoch): the rerun resumes
    there, trains steps 3 and 4 in the second epoch, and ends as the uninterrupted run."""
    run_and_kill(tiny_model_dir, tmp_path, tmp_path / "ckpt" / "step_2" / "training_info.json", 0.0)
    assert not (tmp_path / "ckpt" / "step_4").exists()
    info = tmp_path / "ckpt" / "step_2" / "train_dataloader.pt"
    state = torch.load(info, weights_only=True)
    assert (state["epoch"], state["batch_in_epoch"]) == (0, 2)  # the first epoch is exactly used up
    result = run_to_end(tiny_model_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed from" in result.stderr
    steps = [r["step"] for r in read_metrics(tmp_path / "logs")]
    assert steps == [1, 2, 3, 4]  # two more steps, in the second epoch
    final = torch.load(tmp_path / "ckpt" / "step_4" / "train_dataloader.pt", weights_only=True)
    assert (final["epoch"], final["batch_in_epoch"]) == (1, 2)
    assert_same_as(reference, tmp_path)


@pytest.mark.slow
def test_rerunning_a_complete_run_exits_zero_without_training(reference: Path, tiny_model_dir: Path):
    before = comparable(reference)
    mtime = (reference / "ckpt" / "step_4" / "training_info.json").stat().st_mtime
    result = run_to_end(tiny_model_dir, reference)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "already complete" in result.stderr
    assert comparable(reference) == before
    assert (reference / "ckpt" / "step_4" / "training_info.json").stat().st_mtime == mtime


def test_a_run_finished_at_its_step_limit_is_recognised_before_anything_starts(
    reference: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``finished_run``: what ``rlfleet grpo`` asks before it loads anything (the reference ends at 4)."""

    def config(run: Path, *extra: str) -> MasterConfig:
        overrides = [*small_grpo_overrides(tiny_model_dir, run), *EXTRA, *extra]
        return load_recipe(resolve_recipe_path("grpo-tiny-arithmetic-cpu"), overrides)

    info = CheckpointManager.load_training_info(reference / "ckpt" / "step_4")
    done = finished_run(config(reference, "grpo.max_num_steps=4"), "grpo", 4)
    assert (
        done == run_metrics(info) and done["train/loss"] == read_metrics(reference / "logs")[-1]["train/loss"]
    )
    # its epoch limit ended it, not max_num_steps (100): only the started run can tell, so no answer here
    assert finished_run(config(reference), "grpo", 100) is None
    # killed after its last checkpoint, before that step's log line: the started run restores the line
    killed = tmp_path / "killed"
    shutil.copytree(reference, killed)
    log = killed / "logs" / "metrics.jsonl"
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:-1]))
    assert finished_run(config(killed, "grpo.max_num_steps=4"), "grpo", 4) is None
    # a recipe the checks refuse is refused, finished or not
    with pytest.raises(ConfigError):
        finished_run(config(reference, "grpo.max_num_steps=4", "policy.train_micro_batch_size=3"), "grpo", 4)
