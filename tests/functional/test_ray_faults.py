"""Checkpoints of a sharded run resume on another world size; killed workers are replaced or reported.

Reference: one uninterrupted 4-step run on 2 FSDP ranks. A run stopped at step 2 and resumed on 1 or 4
ranks, a run whose dedicated generation worker is killed, and a run whose training rank is killed and
that is then rerun, must all log the reference's metrics.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import ray

from rlfleet.algorithms.grpo import GRPO
from rlfleet.distributed.ray_policy import TrainingWorkerLostError
from rlfleet.logging import read_metrics
from tests.conftest import kill_and_wait, small_grpo_config
from tests.functional.test_ray_grpo import RAY, assert_same_run, comparable

pytestmark = pytest.mark.slow
FOUR_STEPS = [
    "grpo.max_num_steps=4",
    "grpo.val_period=0",
    "grpo.val_at_end=false",
    "policy.train_micro_batch_size=2",
]


def trainer(model_dir: Path, run_dir: Path, *overrides: str) -> GRPO:
    return GRPO(small_grpo_config(model_dir, run_dir, *FOUR_STEPS, *RAY, *overrides))


def before_step(run: GRPO, step: int, action: Callable[[], None]) -> None:
    """Runs ``action`` at the start of step ``step + 1`` (inside the training loop)."""
    original = run.step

    def step_fn() -> dict[str, float]:
        if run.ctx.step == step:
            action()
        return original()

    run.step = step_fn  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def reference(
    ray_cluster: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("reference")
    trainer(tiny_model_dir, run_dir, "cluster.gpus_per_node=2").train()
    return comparable(run_dir)


def test_checkpoint_of_two_ranks_resumes_on_one_and_on_four(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path, reference: list[dict]
) -> None:
    first = tmp_path / "first"
    trainer(tiny_model_dir, first, "cluster.gpus_per_node=2", "grpo.max_num_steps=2").train()
    weights = first / "ckpt" / "step_2" / "policy" / "weights"
    assert sorted(p.name for p in weights.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    for ranks in (1, 4):
        run_dir = tmp_path / f"on_{ranks}"
        shutil.copytree(first, run_dir)
        resumed = trainer(tiny_model_dir, run_dir, f"cluster.gpus_per_node={ranks}")
        assert resumed.ctx.step == 2
        resumed.train()
        assert_same_run(comparable(run_dir), reference)


def test_killed_generation_worker_is_replaced_and_the_step_retried(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path, reference: list[dict]
) -> None:
    run = trainer(
        tiny_model_dir,
        tmp_path,
        "cluster.gpus_per_node=3",
        "policy.generation.colocated.enabled=false",
        "policy.generation.colocated.resources.num_nodes=1",
        "policy.generation.colocated.resources.gpus_per_node=1",
    )
    before_step(run, 1, lambda: kill_and_wait(run.backend.runtime.gen.actors[0]))
    run.train()
    assert_same_run(comparable(tmp_path), reference)
    restarts = [r.get("perf/generation_restarts") for r in read_metrics(tmp_path / "logs")]
    assert restarts[1:] == [0.0, 1.0, 1.0, 1.0]


def test_killed_training_worker_stops_clearly_and_the_rerun_resumes(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path, reference: list[dict]
) -> None:
    run = trainer(tiny_model_dir, tmp_path, "cluster.gpus_per_node=2")
    before_step(run, 2, lambda: kill_and_wait(run.backend.runtime.train.actors[1]))
    with pytest.raises(TrainingWorkerLostError, match=r"(?s)rank 1 died.*resume from the last checkpoint"):
        run.train()
    assert not ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )
    rerun = trainer(tiny_model_dir, tmp_path, "cluster.gpus_per_node=2")
    assert rerun.ctx.step == 2
    rerun.train()
    assert_same_run(comparable(tmp_path), reference)
