"""A killed training rank ends the run clearly, and its sharded checkpoint resumes on another world size.

Reference: one uninterrupted 4-step run in one process (which two FSDP ranks equal: test_ray_grpo). A run on
2 FSDP ranks whose rank 1 is killed after step 2, rerun from its checkpoint in one process (no Ray) and on
4 ranks, must log the reference's metrics. (A killed dedicated
generation worker, replaced and the step carried on, is test_ray_vllm's dedicated run; engines that keep
dying are test_ray_user_paths'.)
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import ray

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.distributed.ray_policy import TrainingWorkerLostError
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
    """The 4-step run on ``overrides`` (no Ray unless they ask for it)."""
    return GRPO(small_grpo_config(model_dir, run_dir, *FOUR_STEPS, *overrides))


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
    trainer(tiny_model_dir, run_dir).train()
    return comparable(run_dir)


def test_killed_training_worker_stops_clearly_and_the_rerun_resumes_in_one_process_and_on_four_ranks(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path, reference: list[dict]
) -> None:
    run = trainer(tiny_model_dir, tmp_path, *RAY, "cluster.gpus_per_node=2")
    before_step(run, 2, lambda: kill_and_wait(run.backend.runtime.train.actors[1]))
    with pytest.raises(TrainingWorkerLostError, match=r"(?s)rank 1 died.*resume from the last checkpoint"):
        run.train()
    assert not ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )
    # the two ranks' checkpoint of step 2 resumes in one process and on four ranks (DCP reshards it)
    weights = tmp_path / "ckpt" / "step_2" / "policy" / "weights"
    assert sorted(p.name for p in weights.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    for name, layout in (("one_process", []), ("on_4", [*RAY, "cluster.gpus_per_node=4"])):
        run_dir = tmp_path.parent / f"{tmp_path.name}_{name}"
        shutil.copytree(tmp_path, run_dir)
        rerun = trainer(tiny_model_dir, run_dir, *layout)
        assert rerun.ctx.step == 2
        rerun.train()
        assert_same_run(comparable(run_dir), reference)
