"""The variants keep the Ray run equal to the one-process run: DAPO's partial steps (fewer rows than
``P x G``, split over 2 FSDP ranks), Dr.GRPO's constant normaliser and the ICEPOP correction, together."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.functional.test_ray_grpo import RAY, assert_same_run, run

VARIANTS = (
    "env.math.reward_fn=tests.functional.rewards_for_tests.digits_for_even_gold_reward",
    "grpo.use_dynamic_sampling=true",
    "grpo.dynamic_sampling_max_gen_batches=1",
    "grpo.normalize_rewards=false",
    "loss_fn.token_level_loss=false",
    "loss_fn.max_length_normalization=true",
    "loss_fn.use_importance_sampling_correction=true",
    "loss_fn.truncated_importance_sampling_type=icepop",
    "loss_fn.truncated_importance_sampling_ratio=1.01",
    "loss_fn.truncated_importance_sampling_ratio_min=0.99",
)


@pytest.mark.slow
def test_two_fsdp_workers_match_one_process_on_partial_dynamic_sampling_steps(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    single = run(tiny_model_dir, tmp_path / "single", *VARIANTS)
    assert any(r.get("train/dynamic_sampling_filled") == 0.0 for r in single)  # a partial step happened
    assert any(r.get("train/update_skipped") == 0.0 for r in single)
    two = run(tiny_model_dir, tmp_path / "two", *VARIANTS, *RAY, "cluster.gpus_per_node=2")
    assert_same_run(two, single)
    for mine, theirs in zip(two, single, strict=True):
        for key in ("train/is_oob_ratio", "train/sampling_importance_ratio"):
            if key in theirs:
                assert mine[key] == pytest.approx(theirs[key], rel=2e-3, abs=2e-5), key
