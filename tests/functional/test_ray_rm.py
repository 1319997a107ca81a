"""Reward-model training on Ray: two FSDP2 training ranks (whole pairs each, packed in pairs, no generation
engine) give the run of one process, step for step."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.algorithms.rm.loop import RM
from tests.functional.test_ray_grpo import RAY, assert_same_run, comparable
from tests.functional.test_rm import small_pairs, small_rm_config

EXACT = ("train/num_pairs", "train/num_tokens", "val/num_valid_samples")
CLOSE = (
    "train/loss",
    "train/accuracy",
    "train/grad_norm",
    "train/rewards_chosen_mean",
    "val/loss",
    "val/accuracy",
    "val/rewards_rejected_mean",
)
PACKED = ("policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=320")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_pairs(tmp_path_factory.mktemp("pairs"))


def run(model_dir: Path, run_dir: Path, pairs: Path, *overrides: str) -> list[dict]:
    RM(small_rm_config(model_dir, run_dir, pairs, *PACKED, *overrides)).train()
    return comparable(run_dir)


def test_two_fsdp_workers_match_one_process(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path, pairs: Path
) -> None:
    single = run(tiny_model_dir, tmp_path / "single", pairs)
    two = run(tiny_model_dir, tmp_path / "two", pairs, *RAY, "cluster.gpus_per_node=2")
    assert [r["step"] for r in single] == [1, 2]
    assert_same_run(two, single, EXACT, CLOSE)
    assert single[-1]["val/num_valid_samples"] == 16
