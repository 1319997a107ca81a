"""The Ray paths a user takes, end to end, on real clusters, with their failures.

- `rlfleet grpo ... cluster.use_ray=true` with `RAY_ADDRESS` naming a running cluster (the `ray_head`
  fixture: `ray start --head`, token authentication) joins that cluster and trains there; an address that
  is no reachable Ray cluster is one message and exit code 2, never a hang or a traceback.
- `rlfleet submit` with its default entrypoint (the job's own `rlfleet grpo recipe.yaml ...`) trains on the
  cluster; a user error raised inside a Ray actor (a LoRA target the model does not have, found when the
  training actor builds the model) fails the job with the message and exit code 2.
- Asynchronous GRPO with a dedicated generation worker: workers that keep dying end the run
  once `cluster.generation_retries` is spent, and a generation call that hangs ends it after
  `cluster.call_timeout_s`, each with one error naming the settings, and with everything released.

The subprocess runs are bounded by their `timeout`, the in-process ones by `pytest.mark.timeout`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.deploy import jobs
from rlfleet.distributed.rank_group import RankDiedError, RankTimeoutError
from rlfleet.distributed.ray_generation import GenerationWorkerLostError
from rlfleet.logging import read_metrics
from tests.conftest import (
    RayHead,
    cli_argv,
    cli_env,
    free_port,
    kill_and_wait,
    small_grpo_config,
    small_grpo_overrides,
)
from tests.functional.test_async_grpo import ASYNC, DEDICATED
from tests.functional.test_ray_grpo import RAY, TWO_STEPS

RECIPE = "grpo-tiny-arithmetic-cpu"
TWO_STEPS_NO_VAL = [*TWO_STEPS, "grpo.val_at_start=false", "grpo.val_at_end=false"]
# a LoRA target no linear layer of the tiny model has: only the training actor, building the model, sees it
LORA_TARGET_NOBODY_HAS = [
    "policy.dtensor_cfg.lora_cfg.enabled=true",
    "policy.dtensor_cfg.lora_cfg.match_all_linear=false",
    "policy.dtensor_cfg.lora_cfg.target_modules=[nope_proj]",
]


# --------------------------------------------------------------------------------------------- helpers


def head_env(head: RayHead, address: str | None = None) -> dict[str, str]:
    """An `rlfleet` subprocess's environment with the head's token, `RAY_ADDRESS` set to ``address`` (when
    given) and no other `RAY_*` setting of this process."""
    env = {k: v for k, v in cli_env().items() if not k.startswith("RAY_")}
    env |= head.client_env | {"RAY_USAGE_STATS_ENABLED": "0"}
    return env if address is None else env | {"RAY_ADDRESS": address}


def run_rlfleet(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli_argv(*args), env=env, capture_output=True, text=True, timeout=timeout)


def trained_steps(log_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(log_dir) if "train/loss" in r]


def cluster_state(head: RayHead, resource: str, **equal: str) -> list[Any]:
    """The head's record of ``resource`` (``actors``, ``tasks``) whose fields equal ``equal``, dead ones
    included: what ran on that cluster."""
    from ray.util.state.api import StateApiClient
    from ray.util.state.common import ListApiOptions, StateResource

    client = StateApiClient(address=head.url, headers=jobs.auth_headers(head.client_env))
    options = ListApiOptions(limit=1000, detail=True, filters=[(k, "=", v) for k, v in equal.items()])
    return client.list(StateResource(resource), options=options, raise_on_missing_output=False)


def one_error_line(stderr: str) -> str:
    """The single `rlfleet:` line of ``stderr``; fails when there are several, or a traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("rlfleet:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@contextlib.contextmanager
def submitted(head: RayHead, *args: str) -> Iterator[str]:
    """`rlfleet submit --address <head> ARGS` (the default entrypoint); yields the job id and stops the job
    on the way out if it is still running."""
    done = run_rlfleet(head_env(head), "submit", "--address", head.url, *args, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    job_id = done.stdout.strip()
    try:
        yield job_id
    finally:
        with contextlib.suppress(jobs.JobsApiError):
            if jobs.job_status(head.url, job_id, env=head.client_env).status not in jobs.TERMINAL_STATUSES:
                jobs.stop_job(head.url, job_id, env=head.client_env)


def wait_with_cli(head: RayHead, job_id: str) -> subprocess.CompletedProcess[str]:
    """`rlfleet status --wait`: the job's final line and the CLI's exit code (0 SUCCEEDED, 1 otherwise)."""
    return run_rlfleet(head_env(head), "status", "--address", head.url, job_id, "--wait", "300", timeout=360)


# ------------------------------------------------------------------------ 1. an existing Ray cluster


@pytest.mark.timeout(420)
def test_grpo_joins_the_cluster_named_by_ray_address_and_trains_there(
    ray_head: RayHead, tiny_model_dir: Path, tmp_path: Path
) -> None:
    overrides = [*small_grpo_overrides(tiny_model_dir, tmp_path), *TWO_STEPS_NO_VAL, "cluster.use_ray=true"]
    done = run_rlfleet(head_env(ray_head, ray_head.gcs_address), "grpo", RECIPE, *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"connecting to the Ray cluster at {ray_head.gcs_address}" in done.stderr
    assert trained_steps(tmp_path / "logs") == [1, 2]
    # the head recorded this run as one of its drivers, and the run's training worker as its actor
    drivers = [
        j
        for j in jobs.connect(ray_head.url, env=ray_head.client_env).list_jobs()
        if j.type == "DRIVER" and str(tmp_path) in (j.entrypoint or "")
    ]
    assert [d.status for d in drivers] == ["SUCCEEDED"]
    actors = cluster_state(ray_head, "actors", job_id=drivers[0].job_id)
    assert "_RankHost" in {a.class_name for a in actors}


@pytest.mark.parametrize("kind", ["closed port", "dashboard port", "dashboard url"])
@pytest.mark.timeout(300)
def test_ray_address_that_is_no_reachable_cluster_is_one_message_and_exit_2(
    ray_head: RayHead, tiny_model_dir: Path, tmp_path: Path, kind: str
) -> None:
    dashboard = ray_head.url.removeprefix("http://")
    address = {
        "closed port": f"127.0.0.1:{free_port()}",
        "dashboard port": dashboard,  # accepts connections, but speaks HTTP/1.1, not the GCS's gRPC
        "dashboard url": ray_head.url,  # what `rlfleet submit` takes
    }[kind]
    overrides = [*small_grpo_overrides(tiny_model_dir, tmp_path), "cluster.use_ray=true"]
    done = run_rlfleet(
        head_env(ray_head, address), "grpo", RECIPE, *overrides, "cluster.placement_timeout_s=5", timeout=240
    )
    assert done.returncode == 2, done.stderr[-3000:]
    line = one_error_line(done.stderr)
    assert line.startswith("rlfleet: error: ")
    assert repr(address) in line and "RAY_ADDRESS" in line  # the address, and the setting to change
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------ 2. rlfleet submit


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_submit_with_the_default_entrypoint_trains_on_the_cluster(
    ray_head: RayHead, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # the job runs on this machine: its metrics go where logger.log_dir says (/data/... on Kubernetes)
    overrides = [*small_grpo_overrides(tiny_model_dir, tmp_path), *TWO_STEPS_NO_VAL, "cluster.use_ray=true"]
    with submitted(ray_head, RECIPE, *overrides) as job_id:
        status = wait_with_cli(ray_head, job_id)
        logs = jobs.job_logs(ray_head.url, job_id, env=ray_head.client_env)
        assert status.returncode == 0, (status.stdout, logs[-3000:])
        assert f"{job_id}: SUCCEEDED" in status.stdout
    info = jobs.connect(ray_head.url, env=ray_head.client_env).get_job_info(job_id)
    assert info.entrypoint.startswith("rlfleet grpo recipe.yaml ")  # the default entrypoint
    assert "training on 1 Ray worker(s)" in logs
    assert trained_steps(tmp_path / "logs") == [1, 2]
    assert (tmp_path / "ckpt" / "step_2" / "manifest.json").is_file()
    # the job's driver trained through an actor of this cluster
    assert "_RankHost" in {a.class_name for a in cluster_state(ray_head, "actors", job_id=info.job_id)}


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_user_error_raised_in_a_ray_actor_fails_the_job_with_its_message_and_exit_2(
    ray_head: RayHead, tiny_model_dir: Path, tmp_path: Path
) -> None:
    overrides = [
        *small_grpo_overrides(tiny_model_dir, tmp_path),
        *TWO_STEPS_NO_VAL,
        "cluster.use_ray=true",
        *LORA_TARGET_NOBODY_HAS,
    ]
    with submitted(ray_head, RECIPE, *overrides) as job_id:
        status = wait_with_cli(ray_head, job_id)
    assert status.returncode == 1 and f"{job_id}: FAILED" in status.stdout
    assert "exit code 2" in status.stdout  # the job's `rlfleet grpo` exited 2: a user error
    logs = jobs.job_logs(ray_head.url, job_id, env=ray_head.client_env)
    line = one_error_line(logs)
    assert line.startswith("rlfleet: error: policy.dtensor_cfg.lora_cfg: ['nope_proj'] match no linear layer")
    assert "fix:" in line
    # it was raised inside the training actor (building the model there), and crossed Ray to the driver
    driver_job = jobs.connect(ray_head.url, env=ray_head.client_env).get_job_info(job_id).job_id
    failed = cluster_state(ray_head, "tasks", job_id=driver_job, state="FAILED")
    assert [(t.name, t.error_type) for t in failed] == [("_RankHost.construct", "TASK_EXECUTION_EXCEPTION")]
    assert "rlfleet.models.lora.LoraTargetError" in failed[0].error_message
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()


# ------------------------------------------------ 3. asynchronous GRPO, dedicated generation worker


def async_run(model_dir: Path, run_dir: Path, *overrides: str) -> GRPO:
    """Asynchronous GRPO, 1 training worker + 1 dedicated generation worker, 2 steps."""
    return GRPO(
        small_grpo_config(model_dir, run_dir, *RAY, *DEDICATED, *ASYNC, "grpo.max_num_steps=2", *overrides)
    )


def when_prefetching(run: GRPO, action: Any) -> None:
    """Runs ``action`` as the background collection of step 2 starts (while step 1 trains)."""
    original = run.collect

    def collect(step: int) -> Any:
        if step == 1:
            action()
        return original(step)

    run.collect = collect


def assert_all_released(total_cpus: float) -> None:
    """Every placement group of the run removed and its CPUs back (bounded wait: removal is asynchronous)."""
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != total_cpus and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == total_cpus
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generation_engines_that_keep_dying_end_the_run_once_the_retries_are_spent(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The restart logic is the backend's group's, whatever engine it holds: HF engines here (a vLLM engine
    replaced mid-run is test_ray_vllm's)."""
    total = ray.cluster_resources()["CPU"]
    run = async_run(tiny_model_dir, tmp_path, "cluster.generation_retries=1")
    runtime, killed = run.backend.runtime, []

    def kill(actor: Any) -> None:
        kill_and_wait(actor)
        killed.append(actor)

    def engines_keep_dying() -> None:
        kill(runtime.gen.actors[0])  # the engine dies under the prefetch; so does every replacement
        start = runtime.start_generation_group

        def start_one_that_dies() -> Any:
            group = start()
            for actor in group.actors:
                kill(actor)
            return group

        runtime.start_generation_group = start_one_that_dies

    when_prefetching(run, engines_keep_dying)
    with pytest.raises(GenerationWorkerLostError) as err:
        run.train()
    text = str(err.value)
    assert "generation failed after 1 restart(s)" in text
    assert "cluster.generation_retries=1" in text and "cluster.call_timeout_s" in text
    assert isinstance(err.value.__cause__, RankDiedError)
    assert run.backend.restarts == 1 and len(killed) == 2  # the first engine, then its one replacement
    # step 1 waits for step 2's batch before it ends: it fails, and is neither logged nor checkpointed
    assert trained_steps(tmp_path / "logs") == [] and not (tmp_path / "ckpt" / "step_1").exists()
    assert_all_released(total)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_generation_call_that_hangs_ends_the_run_after_the_call_timeout(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    total = ray.cluster_resources()["CPU"]
    run = async_run(tiny_model_dir, tmp_path, "cluster.call_timeout_s=15", "cluster.generation_retries=0")
    engine = run.backend.runtime.gen.actors[0]
    pid = ray.get(engine.__ray_call__.remote(lambda host: os.getpid()), timeout=30)
    when_prefetching(run, lambda: os.kill(pid, signal.SIGSTOP))  # the engine stops answering mid-run
    try:
        with pytest.raises(GenerationWorkerLostError) as err:
            run.train()
        text = str(err.value)
        assert "did not answer within 15s" in text and "raise cluster.call_timeout_s" in text
        assert "cluster.generation_retries=0" in text
        assert isinstance(err.value.__cause__, RankTimeoutError)
        assert trained_steps(tmp_path / "logs") == [] and not (tmp_path / "ckpt" / "step_1").exists()
        assert_all_released(total)
        deadline = time.monotonic() + 30  # the stopped engine was killed, not left behind
        while _proc_state(pid) not in ("", "Z") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _proc_state(pid) in ("", "Z")
    finally:
        if _proc_state(pid) == "T":  # still our stopped engine, whatever failed: never leave it behind
            os.kill(pid, signal.SIGKILL)


def _proc_state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` (``T`` stopped, ``Z`` zombie), or "" when it is gone."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0]
    return ""
