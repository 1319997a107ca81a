"""`rlfleet submit/status/logs/stop` against a real local Ray head with token authentication (Ray 2.60).

The head is the module's `ray_head` (tests/conftest.py): `ray start --head --block` in its own session,
loopback only, its own temp dir and HOME, a random token, stopped by its own process group, so no other
Ray on the machine is touched. Every wait has a time bound.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlfleet.deploy import jobs
from rlfleet.deploy.cli import add_deploy_commands
from tests.conftest import RayHead

pytestmark = [pytest.mark.timeout(240)]
RECIPE = "grpo-tiny-arithmetic-cpu"


def _python(code: str) -> str:
    return shlex.join([sys.executable, "-c", code])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet")
    add_deploy_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def test_job_succeeds_with_the_recipe_uploaded_and_logs_read(ray_head: RayHead) -> None:
    code = "import yaml; print('hello from rlfleet', sorted(yaml.safe_load(open('recipe.yaml'))))"
    job_id = jobs.submit_recipe(
        ray_head.url,
        RECIPE,
        ["grpo.max_num_steps=1"],
        entrypoint=_python(code),
        submission_id=f"rlfleet-test-ok-{secrets.token_hex(3)}",
        env=ray_head.client_env,
    )
    view = jobs.wait_for_job(ray_head.url, job_id, timeout_s=90, env=ray_head.client_env)
    assert view.status == "SUCCEEDED", view
    logs = jobs.job_logs(ray_head.url, job_id, env=ray_head.client_env)
    # the uploaded recipe.yaml, read in the job: merged with its defaults, its algorithm named
    assert "hello from rlfleet ['algorithm', 'checkpointing', " in logs


def test_failing_job_reports_failed_with_its_error(ray_head: RayHead) -> None:
    job_id = jobs.submit_recipe(
        ray_head.url,
        RECIPE,
        entrypoint=_python("import sys; sys.exit('boom: reward function missing')"),
        submission_id=f"rlfleet-test-fail-{secrets.token_hex(3)}",
        env=ray_head.client_env,
    )
    view = jobs.wait_for_job(ray_head.url, job_id, timeout_s=90, env=ray_head.client_env)
    assert view.status == "FAILED"
    assert "boom: reward function missing" in view.message
    assert "boom: reward function missing" in jobs.job_logs(ray_head.url, job_id, env=ray_head.client_env)


def test_cli_status_logs_and_stop(
    ray_head: RayHead, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for key, value in ray_head.client_env.items():
        monkeypatch.setenv(key, value)
    code = "import time; print('working', flush=True); time.sleep(120)"
    args = _parser().parse_args(["submit", "--address", ray_head.url, RECIPE, "--entrypoint", _python(code)])
    assert args.func(args) == 0
    job_id = capsys.readouterr().out.strip()
    assert job_id.startswith(f"rlfleet-{RECIPE}-")
    deadline = time.monotonic() + 60
    while "working" not in jobs.job_logs(ray_head.url, job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    args = _parser().parse_args(["stop", "--address", ray_head.url, job_id])
    assert args.func(args) == 0
    args = _parser().parse_args(["status", "--address", ray_head.url, job_id, "--wait", "60"])
    assert args.func(args) == 1  # STOPPED
    assert f"{job_id}: STOPPED" in capsys.readouterr().out
    args = _parser().parse_args(["logs", "--address", ray_head.url, job_id, "--follow", "--timeout", "60"])
    assert args.func(args) == 0
    assert "working" in capsys.readouterr().out


def test_missing_or_wrong_token_gets_a_clear_message(ray_head: RayHead, tmp_path: Path) -> None:
    # Each case runs in a fresh interpreter: Ray's client caches the auth mode and token per process
    # (an earlier ray.init or RAY_AUTH_MODE in this one would stand in for the missing token), and also
    # reads ~/.ray/auth_token, which another cluster on this machine may have written.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(tmp_path)}

    def status_error(client_env: dict[str, str]) -> str:
        code = (
            "from rlfleet.deploy import jobs\n"
            "try:\n"
            f"    jobs.job_status({ray_head.url!r}, 'any', env={client_env!r})\n"
            "except jobs.JobsApiError as exc:\n"
            "    print(exc)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        return done.stdout

    assert "HTTP 401; RAY_AUTH_MODE is not set): export RAY_AUTH_MODE" in status_error({})
    assert "HTTP 403" in status_error({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "wrong"})
    submit = [sys.executable, "-m", "rlfleet.cli", "submit", "--address", ray_head.url, RECIPE]
    done = subprocess.run(
        [*submit, "--entrypoint", "true"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "requires token authentication" in done.stderr and "RAY_AUTH_TOKEN" in done.stderr
    assert ray_head.token not in done.stderr
