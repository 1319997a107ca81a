"""`rlfleet submit/status/logs/stop` against a real local Ray head with token authentication (Ray 2.60).

The head is started by this module (`ray start --head --block` in its own session, loopback only, its own
temp dir and HOME, a random token) and stopped by its own process group, so no other Ray on the machine is
touched. Every wait has a time bound.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlfleet.deploy import jobs
from rlfleet.deploy.cli import add_deploy_commands

pytestmark = [pytest.mark.timeout(240)]
RAY = Path(sys.executable).with_name("ray")
RECIPE = "grpo-tiny-arithmetic-cpu"


@dataclass(frozen=True)
class RayHead:
    url: str
    token: str

    @property
    def client_env(self) -> dict[str, str]:
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for_dashboard(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ray start exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{url}/api/version", timeout=2).status_code in (200, 401):
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    pytest.fail(f"Ray dashboard not up after {timeout_s} s:\n{log.read_text()[-3000:]}")


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM `ray start --block` (it stops its children), then kill what is left of its own group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + 5
        try:
            os.killpg(proc.pid, sig)  # start_new_session: the group id is the leader's pid
            while time.monotonic() < deadline:
                os.killpg(proc.pid, 0)  # raises once no process of the group is left
                time.sleep(0.2)
        except ProcessLookupError:
            return


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    if not RAY.is_file():
        pytest.skip("ray is not installed in this environment (pip install 'rlfleet[ray]')")
    tmp = Path(tempfile.mkdtemp(prefix="rlfray-", dir="/tmp"))  # short: Ray's unix socket paths
    (tmp / "home").mkdir()
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env |= {"HOME": str(tmp / "home"), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    env |= {"RAY_USAGE_STATS_ENABLED": "0", "PATH": f"{RAY.parent}{os.pathsep}{env.get('PATH', '')}"}
    port, dashboard_port = _free_port(), _free_port()
    command = [str(RAY), "start", "--head", "--block", "--node-ip-address", "127.0.0.1"]
    command += ["--port", str(port), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port)]
    command += ["--num-cpus", "1", "--temp-dir", str(tmp / "ray"), "--include-dashboard", "true"]
    log = tmp / "ray-start.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{dashboard_port}"
    try:
        _wait_for_dashboard(url, proc, log, timeout_s=90)
        yield RayHead(url, token)
    finally:
        _stop_group(proc)
        shutil.rmtree(tmp, ignore_errors=True)


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
    assert "hello from rlfleet ['checkpointing', " in logs  # the uploaded recipe.yaml, read in the job


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
