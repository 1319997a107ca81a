"""GRPO end to end with a reward model as the environment: the tiny arithmetic recipe scored by a tiny
sequence classifier built here (the policy's tokenizer, random weights), two steps in one process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from rlfleet.algorithms.grpo import GRPO
from rlfleet.logging import read_metrics
from tests.conftest import small_grpo_config
from tests.unit.test_model_environments import save_tiny_reward_model

PREFIX = "env/reward_model/reward_model_env"


def params(trainer: GRPO) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.ctx.policy.model.named_parameters()}


def test_grpo_trains_on_a_reward_models_scores(tiny_model_dir: Path, tmp_path: Path) -> None:
    rm_dir = save_tiny_reward_model(tmp_path / "rm", AutoTokenizer.from_pretrained(tiny_model_dir), seed=1)
    cfg = small_grpo_config(
        tiny_model_dir,
        tmp_path,
        "data.env_name=reward_model",
        f"env.reward_model.model_name={rm_dir}",
        "env.reward_model.batch_size=8",
        "grpo.max_num_steps=2",
        "grpo.val_period=2",
    )
    trainer = GRPO(cfg)
    before = params(trainer)
    trainer.train()
    records = read_metrics(tmp_path / "logs")
    steps = [r for r in records if r["step"] > 0 and f"train/{PREFIX}/mean_reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r[f"train/{PREFIX}/num_samples"] == 16.0  # 4 prompts x 4 generations
        assert r[f"train/{PREFIX}/mean_reward"] == pytest.approx(r["train/reward"], abs=1e-5)
        assert r[f"train/{PREFIX}/std_reward"] > 0.0  # the scores differ, so the advantages are not all 0
        assert math.isfinite(r["train/loss"]) and r["train/reward_errors"] == 0
    assert f"val/{PREFIX}/mean_reward" in records[-1]
    after = params(trainer)
    assert any(not torch.equal(before[name], after[name]) for name in before)  # the policy moved
