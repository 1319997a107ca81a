"""Each loss and sampling variant runs GRPO on the tiny task: steps complete, parameters move, and the
variant's metrics are logged (DAPO, Dr.GRPO, GSPO, the bounded importance-sampling corrections)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.logging import read_metrics
from rlfleet.runtime.loop import MACHINE_METRICS
from tests.conftest import small_grpo_config

DENSE = "env.math.reward_fn=tests.functional.rewards_for_tests.digit_fraction_reward"
HALF = "env.math.reward_fn=tests.functional.rewards_for_tests.digits_for_even_gold_reward"
QUICK = ("grpo.val_at_start=false", "grpo.val_at_end=false", "checkpointing.enabled=false")


def _params(trainer: GRPO) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.ctx.policy.model.named_parameters()}


def _train(model_dir: Path, run_dir: Path, *overrides: str) -> tuple[GRPO, list[dict], bool]:
    """Trains; returns the trainer, the logged records and whether every parameter changed."""
    trainer = GRPO(small_grpo_config(model_dir, run_dir, *QUICK, *overrides))
    before = _params(trainer)
    trainer.train()
    after = _params(trainer)
    moved = all(not torch.equal(before[n], after[n]) for n in before)
    return trainer, read_metrics(run_dir / "logs"), moved


@pytest.mark.slow
def test_dapo_dynamic_sampling_overlong_shaping_and_clip_higher(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer, records, moved = _train(
        tiny_model_dir,
        tmp_path,
        "grpo.max_num_steps=2",
        DENSE,
        "grpo.use_dynamic_sampling=true",
        "grpo.batch_multiplier=1.5",
        "grpo.reward_shaping.enabled=true",
        "grpo.reward_shaping.overlong_buffer_length=4",
        "loss_fn.ratio_clip_max=0.28",
    )
    assert moved
    for r in records:
        assert r["train/dynamic_sampling_filled"] == 1.0 and r["train/dynamic_sampling_groups_kept"] == 4
        assert r["train/dynamic_sampling_prompts_drawn"] == 6 * r["train/dynamic_sampling_rounds"]
        assert r["train/shaped_reward"] <= r["train/reward"] + 1e-6  # the penalty only lowers rewards
        assert r["train/update_skipped"] == 0.0
    rounds = sum(r["train/dynamic_sampling_rounds"] for r in records)
    assert trainer.ctx.loader.batch_in_epoch == rounds  # each round consumed one loader batch of 6 prompts


def test_dynamic_sampling_that_cannot_fill_trains_on_what_it_has(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    _, records, _ = _train(
        tiny_model_dir,
        tmp_path,
        "grpo.max_num_steps=2",
        HALF,
        "grpo.use_dynamic_sampling=true",
        "grpo.dynamic_sampling_max_gen_batches=1",
    )
    partial = [r for r in records if r["train/dynamic_sampling_filled"] == 0.0]
    assert partial, "the half-informative reward should leave some step short of 4 groups in one round"
    for r in partial:
        kept = r["train/dynamic_sampling_groups_kept"]
        assert r["train/dynamic_sampling_rounds"] == 1 and kept < 4
        assert r["train/update_skipped"] == float(kept == 0)
        if kept:
            assert "train/loss" in r and r["train/num_tokens"] > 0


def test_a_step_without_informative_groups_skips_its_update(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer, records, moved = _train(
        tiny_model_dir,
        tmp_path,
        "grpo.max_num_steps=1",
        "env.math.reward_fn=tests.functional.rewards_for_tests.constant_reward",
        "grpo.use_dynamic_sampling=true",
        "grpo.dynamic_sampling_max_gen_batches=3",
    )
    assert not moved
    (r,) = records
    assert r["train/update_skipped"] == 1.0 and r["train/dynamic_sampling_filled"] == 0.0
    assert r["train/dynamic_sampling_rounds"] == 3 and r["train/dynamic_sampling_groups_kept"] == 0
    assert trainer.ctx.loader.batch_in_epoch == 3  # bounded, and every drawn prompt is consumed
    assert "train/loss" not in r


def test_overlong_filtering_masks_truncated_responses(tiny_model_dir: Path, tmp_path: Path) -> None:
    # the untrained model never stops within max_new_tokens: every response is truncated, nothing is trained
    _, records, moved = _train(
        tiny_model_dir, tmp_path, "grpo.max_num_steps=1", DENSE, "grpo.overlong_filtering=true"
    )
    (r,) = records
    assert r["train/truncated_fraction"] == 1.0
    assert not moved and r["train/update_skipped"] == 1.0


@pytest.mark.parametrize(
    "variant",
    [
        (
            "grpo.normalize_rewards=false",
            "loss_fn.token_level_loss=false",
            "loss_fn.max_length_normalization=true",
        ),
        (
            "loss_fn.sequence_level_importance_ratios=true",
            "loss_fn.token_level_loss=false",
            "loss_fn.ratio_clip_min=3e-4",
            "loss_fn.ratio_clip_max=4e-4",
            "policy.optimizer.kwargs.lr=1e-3",  # the second optimizer step's ratios move past the clip
            "policy.scheduler.warmup_steps=0",
        ),
    ],
    ids=["dr_grpo", "gspo"],
)
def test_dr_grpo_and_gspo_train(tiny_model_dir: Path, tmp_path: Path, variant: tuple[str, ...]) -> None:
    _, records, moved = _train(tiny_model_dir, tmp_path, "grpo.max_num_steps=2", DENSE, *variant)
    assert moved
    assert all(r["train/update_skipped"] == 0.0 and "train/loss" in r for r in records)
    if "loss_fn.sequence_level_importance_ratios=true" in variant:
        # two optimizer steps per GRPO step: the second sees sequence ratios off 1, clipped at 3e-4/4e-4
        assert any(r["train/clip_fraction"] > 0 for r in records)


@pytest.mark.parametrize(
    "bound",
    [
        ("loss_fn.truncated_importance_sampling_ratio=1.01",),
        (
            "loss_fn.truncated_importance_sampling_type=icepop",
            "loss_fn.truncated_importance_sampling_ratio=1.01",
            "loss_fn.truncated_importance_sampling_ratio_min=0.99",
        ),
        (
            "loss_fn.truncated_importance_sampling_type=seq-mask-tis",
            "loss_fn.truncated_importance_sampling_ratio=1.002",
            "loss_fn.truncated_importance_sampling_ratio_min=0.999",
        ),
    ],
    ids=["tis", "icepop", "seq-mask-tis"],
)
def test_bounded_importance_sampling_trains_and_reports(tiny_model_dir: Path, tmp_path: Path, bound) -> None:
    _, records, moved = _train(
        tiny_model_dir,
        tmp_path,
        "grpo.max_num_steps=1",
        DENSE,
        "loss_fn.use_importance_sampling_correction=true",
        *bound,
    )
    assert moved
    (r,) = records
    assert 0.0 <= r["train/is_oob_ratio"] <= 1.0
    assert 0.0 < r["train/sampling_importance_ratio"] < 1.1


@pytest.mark.slow
def test_dynamic_sampling_run_resumes_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Extra rounds consume loader batches; a run stopped after step 1 and resumed matches an unbroken one."""
    dapo = (
        HALF,
        "grpo.use_dynamic_sampling=true",
        "grpo.batch_multiplier=1.5",
        "grpo.dynamic_sampling_max_gen_batches=3",
        "checkpointing.save_period=1",
        "grpo.val_period=0",
    )
    full = GRPO(small_grpo_config(tiny_model_dir, tmp_path / "full", "grpo.max_num_steps=2", *dapo))
    full.train()
    GRPO(small_grpo_config(tiny_model_dir, tmp_path / "cut", "grpo.max_num_steps=1", *dapo)).train()
    resumed = GRPO(small_grpo_config(tiny_model_dir, tmp_path / "cut", "grpo.max_num_steps=2", *dapo))
    assert resumed.ctx.step == 1
    resumed.train()
    assert resumed.ctx.loader.state_dict() == full.ctx.loader.state_dict()
    a, b = (
        [
            {k: v for k, v in r.items() if not k.startswith(MACHINE_METRICS)}
            for r in read_metrics(d / "logs")
            if r["step"] == 2
        ]
        for d in (tmp_path / "full", tmp_path / "cut")
    )
    assert a == b and a[0]["train/dynamic_sampling_rounds"] >= 1
    for name, p in _params(full).items():
        torch.testing.assert_close(_params(resumed)[name], p, rtol=0, atol=0, msg=name)
