"""Multi-turn GRPO on Ray: colocated and dedicated generation, environments stepped in Ray actors, and
asynchronous GRPO on an OpenAI-API agent's episodes. Sampling is batch-invariant per turn, so the colocated
run reproduces one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.functional.test_grpo_environments import SCRIPTED, TWO_STEPS, check_multi_turn, train
from tests.functional.test_ray_grpo import RAY, assert_same_run, comparable

pytestmark = pytest.mark.slow

IN_ACTORS = ["env.script.num_workers=2"]  # on Ray: a pool of Ray actors steps the episodes
DEDICATED = [
    "cluster.gpus_per_node=2",
    "policy.generation.colocated.enabled=false",
    "policy.generation.colocated.resources.num_nodes=1",
    "policy.generation.colocated.resources.gpus_per_node=1",
]


def test_colocated_multi_turn_on_ray_matches_one_process(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    train(tiny_model_dir, tmp_path / "one", *SCRIPTED, *TWO_STEPS, "policy.train_micro_batch_size=2")
    _, records = train(
        tiny_model_dir,
        tmp_path / "ray",
        *SCRIPTED,
        *TWO_STEPS,
        *RAY,
        *IN_ACTORS,
        "policy.train_micro_batch_size=2",
    )
    check_multi_turn(records)
    assert_same_run(comparable(tmp_path / "ray"), comparable(tmp_path / "one"))


def test_async_grpo_on_agent_episodes_with_dedicated_generation(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Asynchronous GRPO on episodes an OpenAI-API agent plays: the endpoint in the driver samples from the
    dedicated engine, the next step's agents run while this step trains. (Scripted multi-turn episodes with a
    dedicated engine and the environment in Ray actors are test_ray_vllm's asynchronous run.)"""
    _, records = train(
        tiny_model_dir,
        tmp_path / "async",
        "data.env_name=agent",
        "env.agent.agent_fn=tests.functional.agents_for_tests:two_turns",
        "policy.max_total_sequence_length=200",
        "grpo.max_num_steps=2",
        *RAY,
        *DEDICATED,
        "grpo.async_grpo.enabled=true",
        "loss_fn.use_importance_sampling_correction=true",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
    )
    steps = [r for r in records if r["step"] > 0]
    assert [r["train/trajectory_age"] for r in steps] == [0.0, 1.0]
    assert all(r["train/turns_per_episode"] == 2.0 for r in steps)
    assert all(r["train/agent/requests_per_episode"] == 2.0 and r["train/reward_errors"] == 0 for r in steps)
