"""GRPO on Ray workers gives the run of one process: FSDP ranks, tensor parallelism, dedicated generation.

Every run here is 2 steps of the small recipe from the same seed; sampling is batch-invariant, so the
rollouts (and so the rewards) must be identical and the losses equal within floating-point tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.logging import read_metrics
from rlfleet.runtime.loop import MACHINE_METRICS
from tests.conftest import count_logprob_passes, small_grpo_config

RAY = ["cluster.use_ray=true", "cluster.call_timeout_s=300", "cluster.placement_timeout_s=60"]
TWO_STEPS = ["grpo.max_num_steps=2", "grpo.val_period=0", "policy.train_micro_batch_size=2"]
EXACT = ("val/accuracy", "train/reward", "train/accuracy", "train/mean_response_length", "train/num_tokens")
CLOSE = ("train/loss", "train/kl", "train/ratio", "train/grad_norm", "train/gen_logprob_error")


def comparable(run_dir: Path) -> list[dict]:
    """The run's logged metrics, less those that measure the machine."""
    records = read_metrics(run_dir / "logs")
    return [{k: v for k, v in r.items() if not k.startswith(MACHINE_METRICS)} for r in records]


def run(model_dir: Path, run_dir: Path, *overrides: str) -> list[dict]:
    GRPO(small_grpo_config(model_dir, run_dir, *TWO_STEPS, *overrides)).train()
    return comparable(run_dir)


def assert_same_run(
    got: list[dict], expected: list[dict], exact: Sequence[str] = EXACT, close: Sequence[str] = CLOSE
) -> None:
    """The same steps and metric keys; ``exact`` metrics equal, ``close`` ones within float rounding."""
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for mine, theirs in zip(got, expected, strict=True):
        assert set(mine) == set(theirs)
        for key in exact:
            assert mine.get(key) == theirs.get(key), (mine["step"], key)
        for key in (k for k in close if k in theirs):
            assert mine[key] == pytest.approx(theirs[key], rel=2e-3, abs=2e-5), (mine["step"], key)


@pytest.fixture(scope="module")
def single_process(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run(tiny_model_dir, tmp_path_factory.mktemp("single"))


def test_two_fsdp_workers_match_one_process(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path, single_process: list[dict]
) -> None:
    """Two colocated FSDP2 ranks on Ray; one training worker on Ray is the dedicated-generation run below."""
    two = run(tiny_model_dir, tmp_path / "two", *RAY, "cluster.gpus_per_node=2")
    assert_same_run(two, single_process)
    assert single_process[-1]["train/grad_norm"] > 0
    weights = tmp_path / "two" / "ckpt" / "step_2" / "policy" / "weights"
    assert sorted(p.name for p in weights.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_dedicated_generation_matches_colocated(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path, single_process: list[dict]
) -> None:
    dedicated = [
        "cluster.gpus_per_node=2",
        "policy.generation.colocated.enabled=false",
        "policy.generation.colocated.resources.num_nodes=1",
        "policy.generation.colocated.resources.gpus_per_node=1",
    ]
    got = run(tiny_model_dir, tmp_path / "dedicated", *RAY, *dedicated)
    assert_same_run(got, single_process)
    raw = read_metrics(tmp_path / "dedicated" / "logs")
    assert raw[-1]["timing/refit"] > 0
    assert raw[-1]["perf/generation_workers"] == 1.0 and raw[-1]["perf/training_workers"] == 1.0


def test_tensor_parallel_two_matches_one(ray_cluster: None, tiny_tp_model_dir: Path, tmp_path: Path) -> None:
    tp1 = run(tiny_tp_model_dir, tmp_path / "tp1")  # one process (which one Ray worker equals, above)
    tp2 = run(
        tiny_tp_model_dir,
        tmp_path / "tp2",
        *RAY,
        "cluster.gpus_per_node=2",
        "policy.dtensor_cfg.tensor_parallel_size=2",
    )
    assert_same_run(tp2, tp1)


def test_layout_the_cluster_cannot_hold_fails_fast_and_frees_everything(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import time

    import ray

    from rlfleet.distributed.cluster import ClusterCapacityError

    total = ray.cluster_resources()["CPU"]
    # the placement timeout (3 s), not the call timeout (300 s), ends the wait
    expected = r"not ready after 3s: asked for 1 node\(s\) x 8 bundle\(s\)"
    with pytest.raises(ClusterCapacityError, match=expected):
        GRPO(
            small_grpo_config(
                tiny_model_dir,
                tmp_path,
                *RAY,
                "cluster.gpus_per_node=8",
                "policy.train_micro_batch_size=1",
                "cluster.placement_timeout_s=3",
            )
        )
    deadline = time.monotonic() + 60  # a hang guard: removing placement groups is asynchronous
    while ray.available_resources().get("CPU") != total and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == total  # nothing reserved is left behind


def test_two_fsdp_workers_without_the_prev_pass_match_one_process_with_it(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    on_policy = [*TWO_STEPS, "policy.train_global_batch_size=16"]  # the step's 4 x 4 rows: one update
    separate = GRPO(
        small_grpo_config(tiny_model_dir, tmp_path / "separate", *on_policy), always_compute_prev=True
    )
    separate.train()
    sharded = GRPO(
        small_grpo_config(tiny_model_dir, tmp_path / "sharded", *on_policy, *RAY, "cluster.gpus_per_node=2")
    )
    calls = count_logprob_passes(sharded)
    sharded.train()
    assert calls == [True, True]  # the reference pass of each step, no separate prev pass
    assert_same_run(comparable(tmp_path / "sharded"), comparable(tmp_path / "separate"))
    assert read_metrics(tmp_path / "sharded" / "logs")[-1]["train/gen_logprob_error"] > 0
