"""DPO on Ray: two FSDP2 training ranks (each a whole number of pairs, packed in pairs) give the run of one
process, step for step."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.algorithms.dpo.loop import DPO
from tests.functional.test_dpo import small_dpo_config
from tests.functional.test_ray_grpo import RAY, assert_same_run, comparable

EXACT = (
    "train/sample_reward",
    "train/sample_accuracy",
    "train/num_pairs",
    "train/num_tokens",
    "val/accuracy",
)
CLOSE = ("train/loss", "train/preference_loss", "train/grad_norm", "train/rewards_chosen_mean")
PACKED = ("policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=320")


def run(model_dir: Path, run_dir: Path, *overrides: str) -> list[dict]:
    DPO(
        small_dpo_config(model_dir, run_dir, "dpo.reference_policy_kl_penalty=1.0", *PACKED, *overrides)
    ).train()
    return comparable(run_dir)


def test_two_fsdp_workers_match_one_process(ray_cluster: None, tiny_model_dir: Path, tmp_path: Path) -> None:
    single = run(tiny_model_dir, tmp_path / "single")
    two = run(tiny_model_dir, tmp_path / "two", *RAY, "cluster.gpus_per_node=2")
    assert_same_run(two, single, EXACT, CLOSE)
    assert single[-1]["train/loss"] != pytest.approx(0.693147, abs=1e-4)  # the second step moved
