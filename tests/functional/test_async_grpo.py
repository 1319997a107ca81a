"""Asynchronous GRPO on Ray: 1 training worker + 1 dedicated generation worker, generation of the next step
overlapping the training of this one; batches one policy version old; what a resume regenerates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.checkpoint import CheckpointManager
from rlfleet.config import ConfigError, check_config
from rlfleet.logging import read_metrics
from tests.conftest import small_grpo_config

RAY = ["cluster.use_ray=true", "cluster.call_timeout_s=300", "cluster.placement_timeout_s=60"]
DEDICATED = [
    "cluster.gpus_per_node=2",
    "policy.generation.colocated.enabled=false",
    "policy.generation.colocated.resources.num_nodes=1",
    "policy.generation.colocated.resources.gpus_per_node=1",
]
ASYNC = [
    "grpo.async_grpo.enabled=true",
    "loss_fn.use_importance_sampling_correction=true",
    "loss_fn.truncated_importance_sampling_ratio=2.0",
    "grpo.val_period=0",
    "grpo.val_at_start=false",
    "policy.train_micro_batch_size=2",
    "policy.optimizer.kwargs.lr=1e-3",  # large steps, so that one version of staleness shows
    "checkpointing.save_period=1",
    "env.math.reward_fn=tests.functional.rewards_for_tests.digit_fraction_reward",  # a signal in every group
]


def prompts_by_step(run_dir: Path) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in (run_dir / "logs" / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], []).append(row["prompt"])
    return out


@pytest.mark.slow
def test_async_grpo_overlaps_trains_on_one_version_old_batches_and_resumes(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "async"
    cfg = small_grpo_config(tiny_model_dir, run_dir, *RAY, *DEDICATED, *ASYNC, "grpo.max_num_steps=3")
    GRPO(cfg).train()
    rows = [r for r in read_metrics(run_dir / "logs") if "train/loss" in r]
    assert [r["train/trajectory_age"] for r in rows] == [0.0, 1.0, 1.0]
    # the first batch is on-policy; later ones were sampled by the weights one update older
    assert rows[0]["train/gen_logprob_error"] < 1e-3
    assert all(r["train/gen_logprob_error"] > rows[0]["train/gen_logprob_error"] for r in rows[1:])
    assert all("timing/generation_wait" in r for r in rows[:2])  # the last step prefetches nothing
    assert all(r["timing/refit"] > 0 for r in rows)
    # a checkpoint records the loader position before the prefetched batch's prompts were drawn
    state = CheckpointManager(run_dir / "ckpt").load_dataloader_state(run_dir / "ckpt" / "step_2")
    assert state["batch_in_epoch"] == 2

    # resume from step 2: the batch of step 3 is regenerated from the same prompts, on-policy
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "ckpt").mkdir(parents=True)
    shutil.copytree(run_dir / "ckpt" / "step_2", resumed_dir / "ckpt" / "step_2")
    shutil.copytree(run_dir / "logs", resumed_dir / "logs")
    cfg = small_grpo_config(tiny_model_dir, resumed_dir, *RAY, *DEDICATED, *ASYNC, "grpo.max_num_steps=3")
    GRPO(cfg).train()
    resumed = [r for r in read_metrics(resumed_dir / "logs") if "train/loss" in r]
    assert resumed[-1]["step"] == 3 and resumed[-1]["train/trajectory_age"] == 0.0
    assert prompts_by_step(resumed_dir)[3] == prompts_by_step(run_dir)[3]


def test_async_needs_dedicated_generation_and_the_correction(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = small_grpo_config(tiny_model_dir, tmp_path, "grpo.async_grpo.enabled=true")
    with pytest.raises(ConfigError) as err:
        check_config(cfg, "grpo")
    text = str(err.value)
    assert "policy.generation.colocated.enabled=false" in text
    assert "fix: loss_fn.use_importance_sampling_correction=true" in text
    ok = small_grpo_config(tiny_model_dir, tmp_path, *DEDICATED, *ASYNC)
    check_config(ok, "grpo")
