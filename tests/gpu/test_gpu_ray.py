"""On a GPU: GRPO through a Ray worker trains in bf16 compute over fp32 master weights (FSDP2 mixed
precision), generates from a bf16 engine refitted in place, and matches the in-process float32 run's
rewards on its first step (same rollouts before any update). With two GPUs and the vllm extra: GRPO with a
dedicated vLLM engine actor, refitted by NCCL broadcast from training rank 0."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.logging import read_metrics
from tests.conftest import small_grpo_config
from tests.functional.test_ray_grpo import RAY, TWO_STEPS, comparable

pytest.importorskip("ray")  # the machine may lack the ray extra: these tests skip, the others run

pytestmark = pytest.mark.gpu


def test_ray_bf16_grpo_on_gpu_trains(ray_cluster: None, tiny_model_dir: Path, tmp_path: Path) -> None:
    run = GRPO(small_grpo_config(tiny_model_dir, tmp_path, *TWO_STEPS, *RAY, "policy.precision=bfloat16"))
    assert run.backend.runtime.training().run_all("placement") == [{"rank": 0, "dp_rank": 0, "tp_rank": 0}]
    run.train()
    records = [r for r in comparable(tmp_path) if "train/loss" in r]
    assert len(records) == 2
    for record in records:
        assert math.isfinite(record["train/loss"]) and math.isfinite(record["train/grad_norm"])
        assert record["train/gen_logprob_error"] < 0.05  # bf16 engine vs bf16-compute trainer


def test_ray_worker_on_gpu_matches_in_process_first_step(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    GRPO(small_grpo_config(tiny_model_dir, tmp_path / "local", *TWO_STEPS)).train()
    GRPO(small_grpo_config(tiny_model_dir, tmp_path / "ray", *TWO_STEPS, *RAY)).train()
    local = [r for r in comparable(tmp_path / "local") if "train/loss" in r]
    ray_run = [r for r in comparable(tmp_path / "ray") if "train/loss" in r]
    assert ray_run[0]["train/reward"] == local[0]["train/reward"]
    assert ray_run[0]["train/loss"] == pytest.approx(local[0]["train/loss"], rel=1e-2, abs=1e-4)


@pytest.mark.parametrize("layout", ["colocated", "dedicated"])
def test_vllm_engine_on_ray_trains_from_the_refitted_weights(
    ray_cluster: None, tiny_vllm_model_dir: Path, tmp_path: Path, layout: str
) -> None:
    pytest.importorskip("vllm")
    if layout == "dedicated" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: one training rank and one dedicated vLLM engine")
    from tests.functional.test_ray_vllm import DEDICATED, VLLM

    bf16 = ["policy.precision=bfloat16", "policy.generation.vllm_cfg.gpu_memory_utilization=0.3"]
    where = DEDICATED if layout == "dedicated" else []
    run = GRPO(small_grpo_config(tiny_vllm_model_dir, tmp_path, *TWO_STEPS, *RAY, *VLLM, *where, *bf16))
    if layout == "dedicated":
        specs = run.backend.runtime.gen.run_all("weight_spec")
        assert [spec.dtype for spec in specs] == [torch.bfloat16]  # the broadcast's dtype
    else:
        assert run.backend.runtime.gen is None  # the engine lives in the training rank's actor
    run.train()
    records = [r for r in read_metrics(tmp_path / "logs") if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert math.isfinite(record["train/loss"]) and math.isfinite(record["train/grad_norm"])
        assert record["train/gen_logprob_error"] < 0.05  # bf16 engine vs bf16-compute trainer, after refit
        assert record["perf/generation_workers"] == 1.0 and record["perf/generation_restarts"] == 0.0
        assert record["timing/refit"] > 0
