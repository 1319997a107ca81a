"""The sandbox's promises hold for every caller, not only for root: hostile code run by a root caller (CI) and
by an unprivileged one, each checked against what ``result.isolation`` claims.

CI runs as root, so the unprivileged caller is a small script run as ``CALLER_UID`` (no passwd entry needed)
with a HOME of its own and a copy of the sandbox's modules on ``PYTHONPATH``; it prints the result as JSON.
That caller gets the user-namespace mode where the kernel lets an unprivileged user make one (probed first),
and the tests then require it; elsewhere they check that the report of the fallback is honest. HOME and the
"project" live under ``/home``: inside the sandbox ``/tmp`` is a private tmpfs, so a target there would be
out of reach for another reason than the one under test.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import rlfleet
from rlfleet.environments import cgroups
from rlfleet.environments.sandbox import SandboxLimits, SandboxResult, run_python
from tests.unit.test_sandbox import processes_of

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox's isolation is Linux only")

IS_ROOT = os.geteuid() == 0
CALLER_UID = 2_000_031  # the unprivileged caller
SANDBOX_UID = 2_000_029  # the sandbox user of the root caller: its processes are the sandbox's alone
LIMITS: dict[str, Any] = {
    "cpu_seconds": 5,
    "wall_seconds": 30,
    "memory_bytes": 256 * 2**20,
    "file_size_bytes": 2**20,
    "disk_bytes": 4 * 2**20,
    "max_processes": 16,
    "uid": SANDBOX_UID,
    "gid": SANDBOX_UID,
}
SANDBOX_MODULES = ("sandbox.py", "_bootstrap.py", "cgroups.py", "seccomp.py", "sandbox_dirs.py")
CALLER_SCRIPT = """
import dataclasses, json, sys
from rlfleet.environments.sandbox import SandboxLimits, run_python
request = json.loads(sys.argv[1])
result = run_python(request["code"], SandboxLimits(**request["limits"]))
out = dataclasses.asdict(result)
del out["limits"]
out["summary"] = result.summary
print(json.dumps(out))
"""
USER_NAMESPACE_PROBE = (
    "import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0)"
)


def as_dict(result: SandboxResult) -> dict[str, Any]:
    out = dataclasses.asdict(result)
    del out["limits"]
    out["summary"] = result.summary
    return json.loads(json.dumps(out))  # the shape the unprivileged caller prints


def wait_for(condition: Any, what: str) -> None:
    """A hang guard for asynchronous events (a process dying); the assertion is the condition itself."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.05)


@dataclass
class Caller:
    """Who calls ``run_python``: root in this process, or ``uid`` through ``python`` in a subprocess."""

    name: str
    uid: int
    base: Path  # under /home: HOME, the project, the caller script (and the copied modules)
    python: str | None = None  # the unprivileged caller's interpreter; None: root, in this process
    env: dict[str, str] = field(default_factory=dict)

    @property
    def home(self) -> Path:
        return self.base / "home"

    @property
    def project(self) -> Path:
        return self.base / "project"

    @property
    def workdirs(self) -> Path:
        return Path("/tmp" if self.python else tempfile.gettempdir()) / f"rlfleet-sandboxes-{self.uid}"

    def command(self, code: str, limits: dict[str, Any]) -> list[str]:
        request = json.dumps({"code": code, "limits": {**LIMITS, **limits}})
        return [self.python or sys.executable, str(self.base / "caller.py"), request]

    def spawn(self, code: str, **limits: Any) -> subprocess.Popen[str]:
        """Starts a caller running ``code`` and returns at once."""
        extra: dict[str, Any] = {}
        if self.python:
            extra = {"user": self.uid, "group": self.uid, "extra_groups": [], "env": self.env}
        return subprocess.Popen(
            self.command(code, limits),
            cwd=self.project,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **extra,
        )

    def run(self, code: str, **limits: Any) -> dict[str, Any]:
        if self.python is None:
            return as_dict(run_python(code, SandboxLimits(**{**LIMITS, **limits})))
        proc = self.spawn(code, **limits)
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr
        result: dict[str, Any] = json.loads(stdout)
        return result

    def user_namespaces_allowed(self) -> bool:
        python, extra = sys.executable, {}
        if self.python:
            python, extra = self.python, {"user": self.uid, "group": self.uid, "extra_groups": []}
        return subprocess.run([python, "-c", USER_NAMESPACE_PROBE], check=False, **extra).returncode == 0


def _interpreter_for(uid: int) -> str | None:
    """A Python >= 3.11 that ``uid`` can run (this one may sit under /root)."""
    version_check = "import sys; sys.exit(sys.version_info < (3, 11))"
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            probe = subprocess.run(
                [candidate, "-c", version_check], user=uid, group=uid, extra_groups=[], check=False
            )
        except OSError:  # missing, or under a directory uid cannot enter
            continue
        if probe.returncode == 0:
            return candidate
    return None


def _copy_sandbox_modules(target: Path) -> None:
    """The sandbox's modules, with empty package files (the real ones import the whole package)."""
    package = Path(rlfleet.__file__).parent
    (target / "rlfleet" / "environments").mkdir(parents=True)
    shutil.copy(package / "errors.py", target / "rlfleet")
    for name in SANDBOX_MODULES:
        shutil.copy(package / "environments" / name, target / "rlfleet" / "environments")
    (target / "rlfleet" / "__init__.py").touch()
    (target / "rlfleet" / "environments" / "__init__.py").touch()


def _make_caller(name: str, base: Path) -> Caller:
    base.chmod(0o755)
    (base / "caller.py").write_text(CALLER_SCRIPT)
    for folder in ("home", "project"):
        (base / folder).mkdir()
    (base / "home" / ".bashrc").write_text("export PATH=$PATH:/opt/bin\n")
    (base / "project" / "README.md").write_text("# project\n")
    if name == "root":
        for path in (base / "home", base / "project"):  # writable by anyone: only a read-only mount stops it
            path.chmod(0o777)
            for child in path.iterdir():
                child.chmod(0o666)
        return Caller(name, 0, base)
    python = _interpreter_for(CALLER_UID)
    if python is None:
        pytest.skip(f"no Python >= 3.11 that uid {CALLER_UID} can run (/usr/bin/python3 is one)")
    _copy_sandbox_modules(base / "src")
    for path in (base / "home", base / "project", base / "home" / ".bashrc", base / "project" / "README.md"):
        os.chown(path, CALLER_UID, CALLER_UID)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(base / "home"), "PYTHONPATH": str(base / "src")}
    return Caller(name, CALLER_UID, base, python=python, env=env)


@pytest.fixture(params=["root", "unprivileged"])
def caller(request: pytest.FixtureRequest) -> Iterator[Caller]:
    if not IS_ROOT:
        pytest.skip("run as root (as CI does): the tests drop to an unprivileged caller themselves")
    base = Path(tempfile.mkdtemp(prefix="rlfleet-test-", dir="/home"))
    try:
        made = _make_caller(request.param, base)
        yield made
        if made.python:
            shutil.rmtree(made.workdirs, ignore_errors=True)
    finally:
        shutil.rmtree(base)


def snapshot(caller: Caller) -> dict[str, str]:
    return {
        str(path): path.read_text()
        for folder in (caller.home, caller.project)
        for path in sorted(folder.iterdir())
    }


WRITE_OUTSIDE = """
import errno
for path, mode in {targets!r}:
    try:
        with open(path, mode) as f:
            f.write("pwned\\n")
        print(path, "written")
    except OSError as exc:
        print(path, errno.errorcode.get(exc.errno, exc.errno))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "no-namespaces"])
def test_home_and_project_stay_unchanged(caller: Caller, namespaces: bool) -> None:
    """Appending to ~/.bashrc and the project's README, creating files beside them: refused by the
    read-only file system (EROFS, for root's sandbox user and the unprivileged caller alike), and
    ``filesystem=True`` only when it was."""
    targets = [
        (str(caller.home / ".bashrc"), "a"),
        (str(caller.home / ".profile"), "x"),
        (str(caller.project / "README.md"), "a"),
        (str(caller.project / "planted.py"), "x"),
    ]
    before = snapshot(caller)
    result = caller.run(WRITE_OUTSIDE.format(targets=targets), namespaces=namespaces)
    verdicts = dict(line.rsplit(" ", 1) for line in result["stdout"].splitlines())
    iso = result["isolation"]
    assert result["exit_code"] == 0 and set(verdicts) == {path for path, _ in targets}, result
    if namespaces and (caller.name == "root" or caller.user_namespaces_allowed()):
        assert iso["filesystem"] is True, iso["notes"]
    if iso["filesystem"]:
        assert set(verdicts.values()) == {"EROFS"}, verdicts
        assert snapshot(caller) == before
    else:  # the report is honest: nothing but permissions stood in the way, and these allow the writes
        assert set(verdicts.values()) == {"written"}, verdicts
        assert iso["disk"] == "per-file"


ALLOCATE_IN_CHILDREN = """
import os
CHUNK = {chunk}
release_read, release_write = os.pipe()
children = []
for i in range({children}):
    ready_read, ready_write = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        print("fork refused", exc.errno)
        break
    if pid == 0:
        os.close(release_write)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # the OOM killer takes a child, not the parent that reports
        try:
            block = b"x" * CHUNK  # every page touched
        except MemoryError:
            os._exit(3)
        os.write(ready_write, b"1")
        os.read(release_read, 1)  # hold it until every child has tried
        os._exit(0)
    os.close(ready_write)
    children.append((pid, ready_read))
for _, ready_read in children:
    os.read(ready_read, 1)
os.close(release_write)
statuses = [os.waitpid(pid, 0)[1] for pid, _ in children]
print("held", sum(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in statuses))
print("oom-killed", sum(os.WIFSIGNALED(s) and os.WTERMSIG(s) == 9 for s in statuses))
print("memory errors", sum(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 3 for s in statuses))
"""


@pytest.mark.timeout(300)
def test_total_memory_is_bounded(caller: Caller) -> None:
    """Eight children each touching 64 MiB under a 256 MiB budget: at most three hold theirs together.
    With a cgroup the kernel kills the rest (and the result says the memory limit was exceeded); without
    one, the process limit refuses the forks that would pass the budget."""
    chunk, budget = 64 * 2**20, LIMITS["memory_bytes"]
    result = caller.run(ALLOCATE_IN_CHILDREN.format(chunk=chunk, children=8))
    iso, out = result["isolation"], result["stdout"]
    counts = {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in out.splitlines()[-3:]}
    assert result["exit_code"] == 0, result
    assert counts["held"] * chunk < budget, out
    if iso["memory"] == "cgroup":
        assert counts["oom-killed"] >= 1 and result["memory_limit_exceeded"], result
        assert iso["max_processes"] == LIMITS["max_processes"]
    else:
        assert iso["memory"] == "per-process", iso
        assert f"fork refused {errno.EAGAIN}" in out, out
        assert iso["max_processes"] * iso["address_space_bytes"] <= budget, iso
    if caller.name == "root" and not isinstance(cgroups.placement(), str):
        assert iso["memory"] == "cgroup", iso["notes"]  # root can make a cgroup here


WRITE_MANY_FILES = """
import errno, os
written = 0
for i in range(16):
    try:
        with open(f"part{{i}}", "wb") as f:
            f.write(b"x" * ({file_size} - 1))  # each under the per-file limit
        written += 1
    except OSError as exc:
        print("file", i, errno.errorcode[exc.errno])
        break
empty = 0
try:
    os.mkdir("many")
    for i in range(100_000):
        open(f"many/{{i}}", "w").close()
        empty += 1
except OSError as exc:
    print("empty file", empty, errno.errorcode[exc.errno])
print("written", written, "empty", empty)
"""


@pytest.mark.timeout(300)
def test_total_disk_is_bounded(caller: Caller) -> None:
    """Files each under the 1 MiB file limit, 16 of them against a 4 MiB disk: ENOSPC beyond the disk (and
    beyond its number of files), where the report says ``disk="tmpfs"``."""
    result = caller.run(WRITE_MANY_FILES.format(file_size=LIMITS["file_size_bytes"]))
    iso, out = result["isolation"], result["stdout"]
    last = out.split()
    written, empty = int(last[-3]), int(last[-1])
    if iso["disk"] == "tmpfs":
        assert f"file {written} ENOSPC" in out and written * LIMITS["file_size_bytes"] <= LIMITS["disk_bytes"]
        assert f"empty file {empty} ENOSPC" in out and empty < 100_000
    else:
        assert not iso["filesystem"] and written == 16, result
    if caller.name == "root" or caller.user_namespaces_allowed():
        assert iso["disk"] == "tmpfs", iso["notes"]


CREATE_A_USER_NAMESPACE = """
import ctypes, errno, os, threading
libc = ctypes.CDLL(None, use_errno=True)
result = libc.unshare(0x10000000)  # CLONE_NEWUSER
print("unshare", result, errno.errorcode.get(ctypes.get_errno(), "-") if result else "-")
thread = threading.Thread(target=print, args=("thread runs",))
thread.start()
thread.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
print("fork", os.WEXITSTATUS(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.timeout(300)
def test_no_new_user_namespace(caller: Caller) -> None:
    """unshare(CLONE_NEWUSER) fails with EPERM (the seccomp filter); threads and fork still work."""
    result = caller.run(CREATE_A_USER_NAMESPACE, memory_bytes=512 * 2**20)  # room for 4 processes, either way
    assert result["isolation"]["user_namespaces_blocked"] is True, result["isolation"]["notes"]
    assert result["stdout"].splitlines() == ["unshare -1 EPERM", "thread runs", "fork 7"], result


@pytest.mark.timeout(300)
def test_a_killed_callers_leftovers_are_swept(caller: Caller) -> None:
    """SIGKILL the caller mid-run: its sandbox dies with it (PR_SET_PDEATHSIG), its working directory and
    cgroup stay behind, and the next caller of the same user removes them."""
    sandbox_uid = SANDBOX_UID if caller.name == "root" else caller.uid
    running = 1 if caller.name == "root" else 3  # the code; or the caller, the bootstrap and the code
    already = set(processes_of(sandbox_uid))
    proc = caller.spawn("import time\ntime.sleep(120)", wall_seconds=200)
    stale: list[Path] = []

    def started() -> bool:
        stale[:] = (
            list(caller.workdirs.glob(f"rlfleet-sandbox-*-{proc.pid}-*")) if caller.workdirs.exists() else []
        )
        return bool(stale) and len(set(processes_of(sandbox_uid)) - already) >= running

    wait_for(started, "the sandbox to start")
    proc.kill()
    proc.communicate()
    wait_for(lambda: not set(processes_of(sandbox_uid)) - already, "the sandbox to die with its caller")
    where = cgroups.placement()
    groups = (
        [] if isinstance(where, str) or caller.name != "root" else [b / stale[0].name for b in where.bases]
    )
    assert stale[0].exists() and all(group.exists() for group in groups)

    assert caller.run("print('next')")["stdout"] == "next\n"
    assert not stale[0].exists() and not any(group.exists() for group in groups)


WALK_READ_ONLY = """
import ctypes, importlib.util, os, sys
spec = importlib.util.spec_from_file_location("bootstrap", sys.argv[1])
bootstrap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bootstrap)
libc, notes = bootstrap._libc(), []
if os.geteuid() != 0:
    assert bootstrap._user_namespace(libc, notes), notes
assert bootstrap._unshare(libc, bootstrap.CLONE_NEWNS, notes, "CLONE_NEWNS"), notes
bootstrap._mount(libc, None, "/", None, bootstrap.MS_REC | bootstrap.MS_PRIVATE, None)
bootstrap._read_only_by_walk(libc)
try:
    with open(sys.argv[2], "a") as f:
        f.write("pwned")
    print("written")
except OSError as exc:
    print(exc.strerror)
"""


@pytest.mark.timeout(120)
def test_the_read_only_fallback_for_kernels_before_5_12(caller: Caller) -> None:
    """Without mount_setattr, a read-only bind remount of each mount point in /proc/self/mountinfo: a
    file the caller may write is then refused."""
    if caller.name != "root" and not caller.user_namespaces_allowed():
        # no user namespace, no mount namespace: nothing to remount, and the report says so
        assert caller.run("pass")["isolation"]["filesystem"] is False
        return
    bootstrap = Path(rlfleet.__file__).parent / "environments" / "_bootstrap.py"
    if caller.python:
        bootstrap = caller.base / "src" / "rlfleet" / "environments" / "_bootstrap.py"
    target = caller.home / ".bashrc"
    before = target.read_text()
    command = [caller.python or sys.executable, "-c", WALK_READ_ONLY, str(bootstrap), str(target)]
    extra: dict[str, Any] = {}
    if caller.python:
        extra = {"user": caller.uid, "group": caller.uid, "extra_groups": []}
    done = subprocess.run(command, capture_output=True, text=True, check=False, **extra)
    assert done.returncode == 0 and done.stdout == "Read-only file system\n", done.stderr
    assert target.read_text() == before
