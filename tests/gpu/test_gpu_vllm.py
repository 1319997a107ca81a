"""On a GPU with the vllm extra: the colocated vLLM backend sleeps between generations, and a refit (wake
weights, load, wake KV cache) makes the engine's logprobs those of the trainer's new weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlfleet.generation.interface import SamplingParams
from rlfleet.generation.vllm import VLLMGenerationBackend, VLLMSettings
from rlfleet.policy.batch import collate
from rlfleet.runtime.components import build_worker
from tests.conftest import small_grpo_config

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(max_new_tokens=16, temperature=0.8)


def worker_and_engine(
    model_dir: Path, tmp_path: Path, max_model_len: int
) -> tuple[Any, VLLMGenerationBackend]:
    """A policy worker of the tiny model and a colocated float32 vLLM engine beside it (sleep mode on)."""
    pytest.importorskip("vllm")
    worker = build_worker(small_grpo_config(model_dir, tmp_path), seed=0, keep_reference=False)
    settings = VLLMSettings(
        precision="float32",
        max_model_len=max_model_len,
        seed=0,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
    )
    return worker, VLLMGenerationBackend(worker.model, worker.tokenizer, settings)


def test_sleep_refit_wake_cycle_tracks_the_trainer(tiny_vllm_model_dir: Path, tmp_path: Path) -> None:
    worker, engine = worker_and_engine(tiny_vllm_model_dir, tmp_path, max_model_len=128)
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


def test_multi_turn_episodes_on_the_gpu_engine_are_token_in_token_out(
    tiny_vllm_model_dir: Path, tmp_path: Path
) -> None:
    """Episodes of 3 turns with stop strings on the GPU vLLM engine: the training sequence holds the sampled
    ids, observations are masked, and the trainer's logprobs of the sampled tokens match the engine's."""
    from rlfleet.data import Example, build_prompts
    from rlfleet.environments.runner import InProcessRunner, build_environment
    from rlfleet.rollouts.episodes import EpisodeRunner

    worker, engine = worker_and_engine(tiny_vllm_model_dir, tmp_path, max_model_len=256)
    try:
        env = build_environment("tests.functional.envs_for_tests:ScriptedEnv", {"turns": 3, "stops": ["e"]})
        runner = EpisodeRunner(engine, worker.tokenizer, {"s": InProcessRunner("s", env)}, "s", 3, 256)
        examples = [Example(f"What is {i} + {i}?", "", str(2 * i)) for i in range(1, 9)]
        prompts = build_prompts(worker.tokenizer, examples, system_prompt=None, max_prompt_tokens=None)[0]
        rollouts = runner.run(prompts, 2, PARAMS, seed=3).rollouts
        assert all(r.info is not None and r.info["turns"] == 3.0 for r in rollouts)
        batch = collate([r.prompt.token_ids for r in rollouts], [r.result.token_ids for r in rollouts],
                        worker.tokenizer.pad_token_id, [r.result.logprobs for r in rollouts],
                        [r.mask for r in rollouts])  # fmt: skip
        assert float(batch.response_mask.sum()) < float(batch.attention_mask.sum())  # observations masked
        trainer = worker.logprobs(batch.to(worker.device), 8, temperature=PARAMS.temperature).cpu()
        error = ((trainer - batch.generation_logprobs).abs() * batch.response_mask).max()
        assert float(error) < 1e-3
    finally:
        engine.close()
