"""A Ray address that names no answering cluster fails fast, with the setting to change, before the run loads
anything (``rlfleet.distributed.cluster.check_ray_address``; the CLI calls it first)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from rlfleet.distributed.cluster import ClusterConnectionError, check_ray_address
from tests.conftest import ROOT, free_port


def test_no_address_and_no_ray_address_checks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    check_ray_address(0.1)  # a local cluster will be started: nothing to reach


def test_a_dashboard_url_is_refused_with_what_training_connects_to() -> None:
    with pytest.raises(ClusterConnectionError, match=r"dashboard URL.*<head host>:<GCS port>"):
        check_ray_address(1.0, "http://127.0.0.1:8265")


def test_a_closed_port_from_ray_address_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    expected = rf"cannot reach the Ray cluster at '{address}'.*RAY_ADDRESS"
    with pytest.raises(ClusterConnectionError, match=expected):
        check_ray_address(2.0)


def test_a_port_that_is_no_gcs_is_refused_within_the_timeout() -> None:
    with socket.socket() as server:  # accepts connections, never speaks HTTP/2
        server.bind(("127.0.0.1", 0))
        server.listen()
        accepted: list[socket.socket] = []
        thread = threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True)
        thread.start()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(ClusterConnectionError, match=r"did not answer as a Ray cluster's GCS within 1s"):
            check_ray_address(1.0, address)
        for conn in accepted:
            conn.close()


def test_the_command_line_refuses_the_address_before_it_loads_torch() -> None:
    code = (
        "import sys\n"
        "from rlfleet.cli import main\n"
        "rc = main(['grpo', 'grpo-tiny-arithmetic-cpu', 'cluster.use_ray=true',\n"
        "           'cluster.placement_timeout_s=2'])\n"
        "print(rc, 'torch' in sys.modules, 'rlfleet.algorithms.grpo.loop' in sys.modules)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "RAY_ADDRESS": f"127.0.0.1:{free_port()}", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.split() == ["2", "False", "False"], done.stderr[-2000:]
    assert "rlfleet: error: cannot reach the Ray cluster" in done.stderr
