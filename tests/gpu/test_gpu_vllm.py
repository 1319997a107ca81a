"""On a GPU with the vllm extra: the colocated vLLM backend sleeps between generations, and a refit (wake
weights, load, wake KV cache) makes the engine's logprobs those of the trainer's new weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlfleet.algorithms.builders import build_worker
from rlfleet.generation.interface import SamplingParams
from rlfleet.generation.vllm import VLLMGenerationBackend, VLLMSettings
from rlfleet.policy.batch import collate
from tests.conftest import small_grpo_config

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(max_new_tokens=16, temperature=0.8)


def test_sleep_refit_wake_cycle_tracks_the_trainer(tiny_vllm_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    worker = build_worker(small_grpo_config(tiny_vllm_model_dir, tmp_path), seed=0, keep_reference=False)
    settings = VLLMSettings(
        precision="float32", max_model_len=128, seed=0, enforce_eager=True, gpu_memory_utilization=0.3
    )
    engine = VLLMGenerationBackend(worker.model, worker.tokenizer, settings)
    try:
        prompts = [worker.tokenizer(f"What is {i} + {i}?")["input_ids"] for i in range(1, 9)]
        engine.generate(prompts, PARAMS, seed=0)
        assert engine.asleep  # the KV cache and weights are released for training
        with torch.no_grad():
            for p in worker.model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        engine.refit()
        assert not engine.asleep
        results = engine.generate(prompts, PARAMS, seed=1)
        batch = collate(prompts, [r.token_ids for r in results], worker.tokenizer.pad_token_id,
                        [r.logprobs for r in results])  # fmt: skip
        trainer = worker.logprobs(batch.to(worker.device), 8, temperature=PARAMS.temperature).cpu()
        error = ((trainer - batch.generation_logprobs).abs() * batch.response_mask).max()
        assert float(error) < 1e-3  # float32 on both sides; GPU kernels differ in summation order
    finally:
        engine.close()
