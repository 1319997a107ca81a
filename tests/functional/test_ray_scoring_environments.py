"""The environments that score with a model, on Ray: each steps in a Ray actor of its own (NeMo RL gives its
reward model a worker), and the trainer never loads their model.

* GRPO with the ``reward_model`` environment on Ray gives the one-process run, step for step.
* The actor runner keeps the in-process runner's semantics (a bad item costs that item), survives its actor
  being killed (started again, the step re-sent), and refuses a GPU the cluster does not have.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import pytest
import ray
from transformers import AutoTokenizer

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.environments.ray_runner import RayActorRunner
from rlfleet.errors import UserError
from rlfleet.logging import read_metrics
from tests.conftest import kill_and_wait, save_tiny_reward_model, small_grpo_config
from tests.functional.test_episodes import FLAKY
from tests.functional.test_ray_grpo import RAY, assert_same_run, comparable

PREFIX = "env/reward_model/reward_model_env"
# the actor computes with its own thread count, so the scores agree to float rounding, not bit for bit
CLOSE = (
    "train/reward",
    "train/mean_response_length",
    "train/loss",
    f"train/{PREFIX}/mean_reward",
    f"train/{PREFIX}/std_reward",
    f"val/{PREFIX}/mean_reward",
)


def rm_run(model_dir: Path, run_dir: Path, rm_dir: Path, *overrides: str) -> None:
    cfg = small_grpo_config(
        model_dir,
        run_dir,
        "data.env_name=reward_model",
        f"env.reward_model.model_name={rm_dir}",
        "env.reward_model.batch_size=8",
        "grpo.max_num_steps=2",
        "grpo.val_period=2",
        *overrides,
    )
    GRPO(cfg).train()


def test_grpo_on_a_reward_models_scores_in_its_ray_actor_matches_one_process(
    ray_cluster: None,
    tiny_model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rm_dir = save_tiny_reward_model(tmp_path / "rm", AutoTokenizer.from_pretrained(tiny_model_dir), seed=1)
    rm_run(tiny_model_dir, tmp_path / "one", rm_dir)
    records = read_metrics(tmp_path / "one" / "logs")
    steps = [r for r in records if r["step"] > 0 and f"train/{PREFIX}/mean_reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r[f"train/{PREFIX}/num_samples"] == 16.0  # 4 prompts x 4 generations
        assert r[f"train/{PREFIX}/mean_reward"] == pytest.approx(r["train/reward"], abs=1e-5)
        assert r[f"train/{PREFIX}/std_reward"] > 0.0  # the scores differ, so the advantages are not all 0
        assert math.isfinite(r["train/loss"]) and r["train/reward_errors"] == 0
        assert r["train/grad_norm"] > 0.0  # the policy moves
    assert f"val/{PREFIX}/mean_reward" in records[-1]

    def not_here(*args: object) -> None:
        raise AssertionError("the trainer loaded the reward model; on Ray its actor does")

    monkeypatch.setattr("rlfleet.environments.reward_model.load_reward_model", not_here)
    with caplog.at_level(logging.INFO, logger="rlfleet.environments.ray_runner"):
        rm_run(tiny_model_dir, tmp_path / "ray", rm_dir, *RAY)
    started = [r.getMessage() for r in caplog.records if "Ray actor pid" in r.getMessage()]
    pids = [int(message.split("pid ")[1].split()[0]) for message in started]
    assert len(pids) == 1 and pids[0] != os.getpid()
    assert_same_run(comparable(tmp_path / "ray"), comparable(tmp_path / "one"), exact=(), close=CLOSE)


def test_the_actor_runner_costs_a_bad_item_only_and_outlives_its_actor(ray_cluster: None) -> None:
    runner = RayActorRunner("flaky", FLAKY, {})
    try:
        logs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]

        def step(*kinds: str) -> list[float | None]:
            report = runner.step(logs * len(kinds), [{"ground_truth": k} for k in kinds])
            return [None if o is None else float(o.reward) for o in report.outcomes]

        assert step("ok", "raise", "ok") == [1.0, None, 1.0]  # stepped alone after the batch failed
        report = runner.step(logs * 2, [{"ground_truth": "ok"}, {"ground_truth": "die"}])
        # the actor died, was started again, the step re-sent, and it died again: the step's items cost
        assert report.outcomes == [None, None] and report.num_errors == 2 and runner.num_restarts == 2
        kill_and_wait(runner._actor)  # killed between steps: the next step starts it again
        assert step("ok") == [1.0] and runner.num_restarts == 3
    finally:
        runner.close()


def test_an_actor_gpu_the_cluster_lacks_is_refused_at_start(ray_cluster: None) -> None:
    if ray.available_resources().get("GPU", 0.0) >= 1:
        pytest.skip("this cluster has a free GPU")
    with pytest.raises(UserError, match=r"env\.judge\.resources\.gpus_per_node=1, but the Ray cluster has 0"):
        RayActorRunner("judge", FLAKY, {}, num_gpus=1)
