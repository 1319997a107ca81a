"""The Python sandbox: the happy path, each limit on a harmless snippet, then the issue's hostile snippets.

Every limit is first shown to work on something harmless (the process limit with 5 forks against a limit of 3)
before the hostile tests rely on it; those run with small bounds (2 s CPU, 256 MiB, 16 processes, a few
seconds of wall clock), so a failure here cannot take the machine down.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from rlfleet.environments import cgroups, sandbox_dirs
from rlfleet.environments.sandbox import SandboxError, SandboxLimits, SandboxResult, run_python

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox's isolation is Linux only")

IS_ROOT = os.geteuid() == 0
SMALL = SandboxLimits(
    cpu_seconds=2,
    wall_seconds=5,
    memory_bytes=256 * 2**20,
    file_size_bytes=2**20,
    max_processes=16,
    max_open_files=32,
    max_output_bytes=64 * 2**10,
)


@pytest.fixture(autouse=True)
def workdirs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Records every working directory made, and checks each is gone once the test ends, and its cgroup."""
    made: list[str] = []
    original = sandbox_dirs.make_workdir

    def recording(code: str, owner: tuple[int, int] | None) -> str:
        made.append(original(code, owner))
        return made[-1]

    monkeypatch.setattr(sandbox_dirs, "make_workdir", recording)
    yield made
    assert not [path for path in made if os.path.exists(path)], "a working directory was left behind"
    where = cgroups.placement()
    bases = () if isinstance(where, str) else where.bases
    left = [base / os.path.basename(path) for base in bases for path in made]
    assert not [path for path in left if path.exists()], "a cgroup was left behind"


def processes_of(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    pids.append(int(entry))
            except FileNotFoundError:
                pass
    return pids


def outputs(result: SandboxResult) -> str:
    return result.stdout + result.stderr


# --- the happy path -----------------------------------------------------------------------------------------


def test_prints_and_exit_codes() -> None:
    result = run_python("print('hello')\nprint(6 * 7)")
    assert result.ok and result.exit_code == 0 and result.stdout == "hello\n42\n"
    assert result.observation == "exit code 0\n--- stdout ---\nhello\n42"
    assert run_python("import sys; sys.exit(3)").exit_code == 3
    exited = run_python("print('bye'); exit(4)")  # exit() without the site module
    assert (exited.exit_code, exited.stdout, exited.summary) == (4, "bye\n", "exit code 4")
    assert not exited.ok


def test_exceptions_give_a_traceback_of_main_py() -> None:
    result = run_python("def f(x):\n    return 1 / x\n\nprint('before')\nf(0)\n")
    assert result.exit_code == 1 and result.stdout == "before\n"
    observation = result.observation
    assert observation.startswith("exit code 1\n--- stdout ---\nbefore\n--- stderr ---\nTraceback")
    assert 'File "main.py", line 5, in <module>' in observation and "return 1 / x" in observation
    assert observation.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in observation  # the runner's own frames are not shown

    syntax = run_python("x = (1,\n")
    assert syntax.exit_code == 1 and 'File "main.py", line 1' in syntax.stderr
    assert "SyntaxError" in syntax.stderr and "Traceback" not in syntax.stderr


def test_stdlib_only_and_main_semantics() -> None:
    code = (
        "import json, math, collections, sys\n"
        "if __name__ == '__main__':\n"
        "    print(json.dumps({'pi': round(math.pi, 2)}), __file__, sys.argv)\n"
        "try:\n    import torch\nexcept ImportError:\n    print('no torch')\n"
        "try:\n    import rlfleet\nexcept ImportError:\n    print('no rlfleet')\n"
    )
    result = run_python(code)
    assert result.ok, result.observation
    assert result.stdout == "{\"pi\": 3.14} main.py ['main.py']\nno torch\nno rlfleet\n"


def test_long_output_is_clipped_in_the_observation() -> None:
    result = run_python("for i in range(2000): print(i)")
    assert result.ok and len(result.stdout.splitlines()) == 2000
    assert "characters omitted" in result.observation and "\n1999" in result.observation
    assert len(result.observation) < 2 * result.limits.max_observation_chars


def test_isolation_is_recorded() -> None:
    result = run_python(
        "import os; print(os.getuid(), os.getgid(), os.getpid(), os.getcwd(), os.listdir('/proc/self/fd'))"
    )
    assert result.ok, result.observation
    uid, gid, pid, cwd, fds = result.stdout.split(maxsplit=4)
    assert fds.strip() == "['0', '1', '2', '3']"  # stdin, stdout, stderr and listdir's own: nothing inherited
    iso = result.isolation
    if IS_ROOT:
        assert (iso.uid, int(uid), int(gid)) == (65534, 65534, 65534)
    else:
        assert iso.uid is None and int(uid) == os.getuid()
    if iso.pid_namespace:
        assert pid == "1"
    assert os.path.basename(cwd).startswith("rlfleet-sandbox-") and not os.path.exists(cwd)
    if IS_ROOT:  # root can always create the namespaces, and this machine has a seccomp filter
        assert iso.network and iso.pid_namespace and iso.filesystem and iso.disk == "tmpfs", iso.notes
        assert iso.user_namespaces_blocked, iso.notes
        if not isinstance(cgroups.placement(), str):
            assert (iso.memory, iso.max_processes) == ("cgroup", 32), iso.notes
    if iso.memory == "per-process":  # the fallback splits the budget: processes x address space <= it
        assert iso.max_processes is not None and iso.address_space_bytes is not None
        assert iso.max_processes * iso.address_space_bytes <= result.limits.memory_bytes
    no_network = run_python("pass", replace(SMALL, isolate_network=False))
    assert not no_network.isolation.network


def test_runs_concurrently_from_threads() -> None:
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_python(f"print({i} * {i})", SMALL), range(6)))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(6)]


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="cpu_seconds"):
        SandboxLimits(cpu_seconds=0)
    with pytest.raises(ValueError, match="wall_seconds"):
        SandboxLimits(wall_seconds=0)


# --- each limit on a harmless snippet -----------------------------------------------------------------------

FORK_FIVE = """
import os, time
made = 0
for i in range(5):
    try:
        pid = os.fork()
    except OSError as exc:
        print("fork", i, "failed:", exc)
        break
    if pid == 0:
        time.sleep(0.5)
        os._exit(0)
    made += 1
print("forked", made)
"""


@pytest.mark.timeout(60)
def test_process_limit() -> None:
    """Five forks against a limit of 3 processes (the program is the first): the third fork fails (the second
    without a cgroup, where 256 MiB buys two processes of 128 MiB). This is the check the fork bomb below
    relies on (without a cgroup, root ignores RLIMIT_NPROC: the uid drop is what makes it hold; without root
    and a user namespace the limit also counts the caller's own processes)."""
    needs_root_for_the_uid_drop()
    result = run_python(FORK_FIVE, replace(SMALL, max_processes=3))
    assert result.ok, result.observation
    cap = result.isolation.max_processes
    assert cap == (3 if result.isolation.memory == "cgroup" else 2), result.isolation
    assert f"fork {cap - 1} failed: [Errno 11] Resource temporarily unavailable" in result.stdout
    assert result.stdout.rstrip().endswith(f"forked {cap - 1}")
    wider = run_python(FORK_FIVE, SMALL)
    assert wider.isolation.max_processes is not None
    assert wider.stdout.rstrip().endswith(f"forked {min(5, wider.isolation.max_processes - 1)}")


@pytest.mark.timeout(60)
def test_cpu_limit() -> None:
    result = run_python("while True:\n    pass", replace(SMALL, cpu_seconds=1, wall_seconds=30))
    assert result.cpu_limit_exceeded and not result.timed_out, result
    assert result.summary == "killed: CPU time limit of 1 s exceeded"
    # wait4's precise CPU time trails the tick-sampled time RLIMIT_CPU is enforced on (0.8 s on a busy VM)
    assert 0.5 <= result.cpu_seconds <= 1.5


def test_memory_limit() -> None:
    result = run_python("x = bytearray(300 * 2**20)", SMALL)
    assert result.memory_limit_exceeded and result.exit_code == 1
    per_process = "" if result.isolation.memory == "cgroup" else " (128 MiB per process)"
    assert result.summary == f"exit code 1: memory limit of 256 MiB{per_process} exceeded"
    assert result.stderr.rstrip().endswith("MemoryError")
    assert run_python("x = bytearray(100 * 2**20); print(len(x))", SMALL).stdout == f"{100 * 2**20}\n"


def test_file_size_limit() -> None:
    result = run_python("open('big', 'wb').write(b'x' * 2 * 2**20)", SMALL)
    assert result.exit_code == 1 and "OSError: [Errno 27] File too large" in result.stderr
    assert run_python("print(open('small', 'wb').write(b'x' * 1000))", SMALL).stdout == "1000\n"


def test_open_files_limit() -> None:
    result = run_python("files = [open('main.py') for _ in range(100)]", SMALL)
    assert result.exit_code == 1 and "Too many open files" in result.stderr
    assert run_python("files = [open('main.py') for _ in range(10)]", SMALL).ok


@pytest.mark.timeout(60)
def test_wall_clock_limit() -> None:
    result = run_python(
        "import time\nprint('sleeping', flush=True)\ntime.sleep(100)", replace(SMALL, wall_seconds=1)
    )
    assert result.timed_out and result.exit_code is None and result.stdout == "sleeping\n"
    assert result.summary == "killed: wall-clock limit of 1 s exceeded"


def test_output_cap() -> None:
    result = run_python("print('y' * 100_000)", replace(SMALL, max_output_bytes=10_000))
    assert result.truncated and len(result.stdout) == 10_000 and not result.ok
    assert result.summary == "killed: output exceeded 10000 bytes (truncated)"
    assert run_python("print('y' * 9_000)", replace(SMALL, max_output_bytes=10_000)).ok


def test_namespaces_can_be_required_or_disabled() -> None:
    without = run_python("print('plain')", replace(SMALL, namespaces=False))
    assert without.ok and without.stdout == "plain\n"
    assert not (without.isolation.network or without.isolation.pid_namespace or without.isolation.filesystem)
    assert without.isolation.disk == "per-file"
    assert any("namespaces disabled" in note for note in without.isolation.notes)
    with pytest.raises(SandboxError, match="isolation required"):
        run_python("print('never')", replace(SMALL, namespaces=False, require_isolation=True))


# --- hostile snippets ---------------------------------------------------------------------------------------


def needs_root_for_the_uid_drop() -> None:
    if not IS_ROOT:
        pytest.skip("the uid drop (and RLIMIT_NPROC holding for a fork bomb) needs the caller to be root")


@pytest.mark.timeout(60)
def test_fork_bomb() -> None:
    needs_root_for_the_uid_drop()
    limits = replace(SMALL, wall_seconds=3)
    result = run_python(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", limits
    )
    assert result.timed_out and result.summary == "killed: wall-clock limit of 3 s exceeded"
    if result.isolation.pid_namespace:
        assert processes_of(limits.uid) == []
    assert run_python("print('next')", SMALL).stdout == "next\n"  # and the run continues


@pytest.mark.timeout(60)
def test_memory_bomb() -> None:
    result = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))", SMALL)
    assert result.memory_limit_exceeded and "MemoryError" in result.observation


@pytest.mark.timeout(60)
def test_infinite_loop() -> None:
    result = run_python("x = 0\nwhile True:\n    x += 1", SMALL)
    assert result.cpu_limit_exceeded or result.timed_out, result
    assert result.summary.startswith("killed: ")


@pytest.mark.timeout(60)
def test_a_gigabyte_of_output() -> None:
    result = run_python("import sys\nfor _ in range(1000):\n    sys.stdout.write('x' * 10**6)", SMALL)
    assert result.truncated and len(result.stdout) + len(result.stderr) <= SMALL.max_output_bytes
    assert result.summary == f"killed: output exceeded {SMALL.max_output_bytes} bytes (truncated)"


def test_the_callers_environment_does_not_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "secret-xyz")
    monkeypatch.setenv("WANDB_API_KEY", "secret-wandb")
    code = f"""
import os
print(sorted(os.environ))
print([v for v in os.environ.values() if 'secret' in v])
for pid in ({os.getpid()}, os.getppid(), 1):
    try:
        print(pid, open(f'/proc/{{pid}}/environ', 'rb').read()[:200])
    except OSError as exc:
        print(pid, type(exc).__name__)
"""
    result = run_python(code, SMALL)
    assert result.ok, result.observation
    assert "secret" not in outputs(result)
    assert result.stdout.splitlines()[:2] == ["['HOME', 'LANG', 'LC_ALL', 'PATH', 'TMPDIR']", "[]"]
    assert f"{os.getpid()} " in result.stdout  # the caller's /proc entry: absent or unreadable


@pytest.mark.timeout(60)
def test_writing_outside_the_working_directory(tmp_path: Path) -> None:
    """With the file system isolated, /tmp and /var/tmp are the sandbox's own (its tmpfs): a write there
    stays there, the caller's /tmp (this test's directory) is not in sight, and everything else is
    read-only. (tests/unit/test_sandbox_isolation.py tries the caller's HOME and project.)"""
    escape = Path(f"/tmp/rlfleet_escape_{uuid.uuid4().hex}")
    var_escape = Path(f"/var/tmp/rlfleet_escape_{uuid.uuid4().hex}")
    own = tmp_path / "escape.txt"
    code = f"""
for path in ({str(escape)!r}, {str(own)!r}, {str(var_escape)!r}, '/etc/rlfleet_escape', 'inside.txt'):
    try:
        with open(path, 'w') as f:
            f.write('pwned')
        print(path, 'written')
    except OSError as exc:
        print(path, type(exc).__name__, exc.strerror)
"""
    result = run_python(code, SMALL)
    assert result.ok, result.observation
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["inside.txt"] == "written"
    assert result.isolation.filesystem or not IS_ROOT, result.isolation.notes
    if not result.isolation.filesystem:  # not root, no user namespace: the report says so, and it is so
        assert lines[str(escape)] == "written"
        escape.unlink()
        var_escape.unlink(missing_ok=True)
        return
    assert not escape.exists() and not var_escape.exists() and not own.exists()
    assert not Path("/etc/rlfleet_escape").exists()
    assert lines[str(escape)] == lines[str(var_escape)] == "written"  # in the sandbox's tmpfs
    assert lines[str(own)] == "FileNotFoundError No such file or directory"
    assert lines["/etc/rlfleet_escape"] == "OSError Read-only file system"


@pytest.mark.timeout(60)
def test_writing_outside_without_namespaces(tmp_path: Path) -> None:
    needs_root_for_the_uid_drop()
    own = tmp_path / "escape.txt"
    result = run_python(f"open({str(own)!r}, 'w')", replace(SMALL, namespaces=False))
    assert result.exit_code == 1 and "PermissionError" in result.stderr and not own.exists()


KILL_THE_CALLER = """
import os, signal
for pid in (os.getppid(), {pid}, -1):
    try:
        os.kill(pid, signal.SIGKILL)
        print(pid, "sent")
    except OSError as exc:
        print(pid, type(exc).__name__)
print("alive")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "uid-only"])
def test_killing_the_caller(namespaces: bool) -> None:
    if not namespaces:
        needs_root_for_the_uid_drop()  # without a PID namespace only the uid protects the caller
    result = run_python(KILL_THE_CALLER.format(pid=os.getpid()), replace(SMALL, namespaces=namespaces))
    lines = result.stdout.splitlines()
    assert f"{os.getpid()} ProcessLookupError" in lines or f"{os.getpid()} PermissionError" in lines, result
    if not result.isolation.pid_namespace:
        assert f"{os.getpid()} PermissionError" in lines
    # this test process is still alive, and so is the bootstrap's reaping of the code
    assert os.getpid() and run_python("print('next')", SMALL).stdout == "next\n"


@pytest.mark.timeout(60)
def test_opening_a_socket() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).sendall(b"leak")
    print("connected")
except OSError as exc:
    print("failed:", exc)
"""
        result = run_python(code, SMALL)
        assert result.isolation.network or not IS_ROOT
        if result.isolation.network:
            assert result.stdout.startswith("failed: [Errno 101] Network is unreachable"), result
            readable, _, _ = select.select([server], [], [], 0)
            assert not readable  # nothing reached the listening socket


@pytest.mark.timeout(60)
def test_escaped_processes_die_with_the_sandbox() -> None:
    """A grandchild in a session of its own outlives its parent; the PID namespace still takes it down (its
    own uid, so that other processes of uid 65534 cannot confuse the count)."""
    needs_root_for_the_uid_drop()
    limits = replace(SMALL, uid=2_000_017, gid=2_000_017)
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(300)\nprint('parent exits')"
    result = run_python(code, limits)
    assert result.ok and result.stdout == "parent exits\n"
    if result.isolation.pid_namespace:
        assert processes_of(limits.uid) == []
    # without a PID namespace the process group is killed: a grandchild that stays in it dies too
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(300)\nprint('parent exits')"
    assert run_python(code, replace(limits, namespaces=False)).ok
    deadline = time.monotonic() + 30  # a hang guard: killing is asynchronous
    while processes_of(limits.uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_of(limits.uid) == []
