"""Runs untrusted Python in a separate, limited, isolated process: :func:`run_python`.

Not ``exec`` with trimmed builtins. Each call gets a new process (``python -I -S -u``: the stdlib only)
started through :mod:`rlfleet.environments._bootstrap` in a new session, with an environment of ``PATH``,
``LANG``/``LC_ALL``, ``HOME`` and ``TMPDIR`` only (nothing of the caller's: ``HF_TOKEN``, ...); a wall-clock
limit (the whole PID namespace, or process group, is killed); an output cap (the code is killed once stdout
and stderr together pass ``max_output_bytes``, read as they come); resource limits (``setrlimit``, soft =
hard: CPU seconds, address space, file size, open files, no core files); and a fresh working directory
(``HOME`` and ``TMPDIR`` too). The rest depends on what the OS lets the caller do, and
:attr:`SandboxResult.isolation` records what was enforced, never what was only tried:

* **Namespaces** (``network``, ``pid_namespace``): as root, or in an unprivileged user namespace of its own
  (a laptop, most clusters), new network, IPC, PID and mount namespaces: no network at all, no process
  outside visible, every process the code started killed with it. As root the code also runs as
  ``SandboxLimits.uid`` (*nobody*): it cannot signal the caller's processes nor read their environment.
* **File system** (``filesystem``): in the mount namespace every mount is read-only (recursively) and a tmpfs
  is the one writable place: the working directory, ``/tmp``, ``/var/tmp`` and ``/dev/shm`` live in it. A
  write anywhere else fails (``EROFS``) whoever the caller is; the tmpfs vanishes with the namespace.
* **Disk** (``disk``): ``"tmpfs"``, the code may write ``disk_bytes`` in all; ``"per-file"`` (no mount
  namespace), only each file's size is bounded (``file_size_bytes``).
* **Memory and processes** (``memory``): ``"cgroup"``, a cgroup of the sandbox's own bounds the memory of all
  its processes together (``memory_bytes``, no swap) and their number (``max_processes``), where the caller
  may make one (:mod:`~rlfleet.environments.cgroups`: root, or a delegated cgroup); else ``"per-process"``:
  ``RLIMIT_NPROC`` and ``RLIMIT_AS`` chosen so that processes x address space <= ``memory_bytes``, each
  with at least ``MIN_PROCESS_ADDRESS_SPACE`` (fewer processes than ``max_processes`` when the budget is
  small). ``address_space_bytes`` and ``max_processes`` say what was set. ``RLIMIT_NPROC`` counts the
  processes of a uid: as root the sandbox uid's, in a user namespace the sandbox's own, else the caller's too.
* **User namespaces** (``user_namespaces_blocked``): a seccomp filter refuses new ones to the code
  (:mod:`~rlfleet.environments.seccomp`), in every mode.
* **Left behind**: nothing (the working directory and the cgroup are removed whatever the code did); when the
  caller itself is killed, the next :func:`run_python` of the same user removes them
  (:mod:`~rlfleet.environments.sandbox_dirs`).

``SandboxLimits.require_isolation`` refuses to run without the network (when isolated), PID and file-system
isolation; ``SandboxLimits.namespaces=False`` turns the namespaces off. On macOS (no namespaces, cgroups nor
seccomp) the resource limits, wall clock, output cap, environment and working directory apply, no more.

The code is the file ``main.py`` in the working directory, run as ``__main__``; a traceback shows its lines.
:attr:`SandboxResult.summary` is a one-line verdict (``exit code 0``, ``killed: CPU time limit of 2 s
exceeded``, ...) and :attr:`SandboxResult.observation` that line followed by the (clipped) output: the text a
tool returns to the model.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlfleet.environments import cgroups, sandbox_dirs
from rlfleet.environments.seccomp import user_namespace_filter
from rlfleet.errors import UserError

__all__ = ["Isolation", "SandboxError", "SandboxLimits", "SandboxResult", "run_python"]

BOOTSTRAP = Path(__file__).with_name("_bootstrap.py")
# Loads the bootstrap as a module, whose bytecode is cached (a script is compiled at every start: ~5 ms).
BOOTSTRAP_LOADER = (
    "import importlib.util, sys; "
    "spec = importlib.util.spec_from_file_location('rlfleet_sandbox_bootstrap', sys.argv[1]); "
    "bootstrap = importlib.util.module_from_spec(spec); spec.loader.exec_module(bootstrap); "
    "bootstrap.main(sys.argv[2])"
)
# Without a cgroup, each process gets at least this much address space (Python itself needs ~25 MiB): a
# small memory budget then buys fewer processes rather than processes too small to run.
MIN_PROCESS_ADDRESS_SPACE = 128 * 2**20
BYTES_PER_INODE, MIN_INODES = 4096, 1024  # the tmpfs's files: one per 4 KiB of disk_bytes, at least 1024
# After the wall clock the bootstrap kills the code; this much later the caller kills the bootstrap too.
BACKSTOP_SECONDS = 5.0
# Once the code has exited, how long to wait for the pipes to close (a straggler without a PID namespace).
DRAIN_SECONDS = 0.5
CPU_EVIDENCE_FRACTION = 0.5  # see _cpu_limit_hit

# Runs the user's main.py as __main__ and prints its traceback without this runner's frames. ``-S`` skips
# the site module, which is what defines exit() and quit(): they are provided. With a cgroup, it first waits
# on the descriptor in argv[1] until the bootstrap has moved it in ("cgroup"), or told it the per-process
# limits to take instead ("<address space> <processes>"; an empty read: the bootstrap is gone).
RUNNER = r"""
import builtins, sys
def _await_the_cgroup():
    import os
    fd = int(sys.argv[1])
    verdict = os.read(fd, 64).split()
    os.close(fd)
    if verdict == [b"cgroup"]:
        return
    if len(verdict) != 2:
        os._exit(125)
    import resource
    for limit, value in zip((resource.RLIMIT_AS, resource.RLIMIT_NPROC), map(int, verdict)):
        resource.setrlimit(limit, (value, value))
if len(sys.argv) > 1:
    _await_the_cgroup()
builtins.exit = builtins.quit = sys.exit
sys.argv = ["main.py"]
def _run():
    import __main__, sys, traceback
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    namespace = __main__.__dict__
    for name in [n for n in namespace if not n.startswith("__")]:
        del namespace[name]
    namespace["__file__"] = "main.py"
    try:
        exec(compile(source, "main.py", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        sys.exit(1)
_run()
"""


class SandboxError(RuntimeError, UserError):
    """The sandbox cannot run here as configured (no usable interpreter, isolation required but missing)."""


@dataclass(frozen=True)
class SandboxLimits:
    """The bounds of one :func:`run_python` call."""

    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    # all the sandbox's processes together (cgroup memory.max, no swap) and each one's address space
    # (RLIMIT_AS); without a cgroup, split between at most memory_bytes // MIN_PROCESS_ADDRESS_SPACE processes
    memory_bytes: int = 512 * 2**20
    file_size_bytes: int = 16 * 2**20  # largest file the code may write (RLIMIT_FSIZE)
    # all the code may write: the tmpfs holding the working directory, /tmp and /dev/shm (its pages count as
    # memory too, in the cgroup)
    disk_bytes: int = 64 * 2**20
    max_processes: int = 32  # processes and threads together (cgroup pids.max, else RLIMIT_NPROC)
    max_open_files: int = 64
    max_output_bytes: int = 64 * 2**10  # stdout + stderr; the code is killed beyond
    isolate_network: bool = True
    # network, IPC, PID and mount namespaces where the OS allows them; False: resource limits, uid drop, wall
    # clock, output cap, environment and working directory only (e.g. where a seccomp profile forbids unshare)
    namespaces: bool = True
    # refuse to run (SandboxError) unless the network (when isolated), PID and mount namespaces were created
    require_isolation: bool = False
    # the uid/gid the code runs as when the caller is root. Without a cgroup, RLIMIT_NPROC counts every
    # process of that uid, so concurrent sandboxes sharing it share the process budget.
    uid: int = 65534
    gid: int = 65534
    # the untrusted interpreter; default: this one if the sandbox uid can run it, else a system python3
    python: str | None = None
    max_observation_chars: int = 2000  # per stream in `observation` (head and tail kept)

    def __post_init__(self) -> None:
        for name in (
            "cpu_seconds",
            "memory_bytes",
            "file_size_bytes",
            "disk_bytes",
            "max_processes",
            "max_open_files",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {getattr(self, name)}")
        if self.wall_seconds <= 0 or self.max_output_bytes < 1 or self.max_observation_chars < 1:
            raise ValueError(
                "SandboxLimits.wall_seconds, max_output_bytes and max_observation_chars must be positive"
            )


MemoryBound = Literal["cgroup", "per-process", "none"]
DiskBound = Literal["tmpfs", "per-file"]


@dataclass(frozen=True)
class Isolation:
    """What was enforced (the module docstring says what each means); never what was only tried."""

    uid: int | None  # the uid the code ran as; None: the caller's own (not root)
    network: bool  # new network namespace: no network
    pid_namespace: bool  # the code is PID 1 of its own PID namespace
    filesystem: bool  # every mount read-only but the sandbox's tmpfs (working dir, /tmp, /var/tmp, /dev/shm)
    disk: DiskBound  # "tmpfs": disk_bytes in all; "per-file": file_size_bytes per file only
    # "cgroup": memory_bytes and max_processes over all the sandbox's processes; "per-process": RLIMIT_AS and
    # RLIMIT_NPROC below; "none": the code never started
    memory: MemoryBound
    address_space_bytes: int | None  # RLIMIT_AS of each process (None: not set)
    max_processes: int | None  # pids.max of the cgroup, else RLIMIT_NPROC (None: not set)
    user_namespaces_blocked: bool  # seccomp: no new user namespace
    notes: tuple[str, ...] = ()  # why something was not enforced


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one :func:`run_python` call."""

    stdout: str
    stderr: str
    exit_code: int | None  # None when killed by a signal, or when the code never started
    signal_number: int | None
    timed_out: bool  # the wall-clock limit
    cpu_limit_exceeded: bool
    # a MemoryError ended the program (the address-space limit), or the kernel killed a process of the
    # sandbox for want of memory (its cgroup)
    memory_limit_exceeded: bool
    truncated: bool  # the output cap: the code was killed and the output cut
    duration_seconds: float
    cpu_seconds: float
    isolation: Isolation
    limits: SandboxLimits = field(repr=False)
    error: str | None = None  # the code could not be started (the message says why)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not (self.timed_out or self.truncated or self.error)

    @property
    def summary(self) -> str:
        """One line: how the run ended."""
        limits = self.limits
        if self.error is not None:
            return f"sandbox error: {self.error}"
        if self.truncated:
            return f"killed: output exceeded {limits.max_output_bytes} bytes (truncated)"
        if self.timed_out:
            return f"killed: wall-clock limit of {limits.wall_seconds:g} s exceeded"
        if self.cpu_limit_exceeded:
            return f"killed: CPU time limit of {limits.cpu_seconds} s exceeded"
        if self.memory_limit_exceeded:
            ended = "killed" if self.exit_code is None else f"exit code {self.exit_code}"
            return f"{ended}: {self._memory_limit()} exceeded"
        if self.signal_number is not None:
            return f"killed by signal {_signal_name(self.signal_number)}"
        return f"exit code {self.exit_code}"

    def _memory_limit(self) -> str:
        total = f"memory limit of {self.limits.memory_bytes // 2**20} MiB"
        per_process = self.isolation.address_space_bytes
        if self.isolation.memory == "cgroup" or per_process is None:
            return total
        return f"{total} ({per_process // 2**20} MiB per process)"

    @property
    def observation(self) -> str:
        """The summary line, then stdout and stderr (each clipped to ``max_observation_chars``)."""
        lines = [self.summary]
        for name, text in (("stdout", self.stdout), ("stderr", self.stderr)):
            if text:
                lines += [f"--- {name} ---", _clip(text.rstrip("\n"), self.limits.max_observation_chars)]
        return "\n".join(lines)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head, tail = limit // 2, limit - limit // 2
    return f"{text[:head]}\n... [{len(text) - limit} characters omitted] ...\n{text[-tail:]}"


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Runs ``code`` as ``main.py`` in a fresh sandbox (see the module docstring); never raises for anything
    the code does. Raises :class:`SandboxError` when no sandbox can be made here."""
    limits = limits or SandboxLimits()
    if os.name != "posix":
        raise SandboxError("the Python sandbox needs a POSIX system (resource limits, sessions)")
    _sweep()
    drop = os.geteuid() == 0
    python = _interpreter(limits, drop)
    return _run(code, limits, drop, python)


def _sweep() -> None:
    """Removes what callers that were killed (SIGKILL, the OOM killer) left: working directories, cgroups."""
    sandbox_dirs.sweep_workdirs()
    cgroups.sweep(sandbox_dirs.owner_alive)


_INTERPRETERS: dict[tuple[int, int], str] = {}
_INTERPRETERS_LOCK = threading.Lock()


def _interpreter(limits: SandboxLimits, drop: bool) -> str:
    """The interpreter the sandboxed code runs with: one the sandbox user can run (``sys.executable`` may sit
    under a directory it cannot enter, e.g. pyenv's under /root), found once by trying."""
    if limits.python is not None:
        return limits.python
    if not drop:
        return sys.executable
    key = (limits.uid, limits.gid)
    with _INTERPRETERS_LOCK:
        if key in _INTERPRETERS:
            return _INTERPRETERS[key]
        candidates = [
            sys.executable,
            getattr(sys, "_base_executable", ""),
            "/usr/local/bin/python3",
            "/usr/bin/python3",
        ]
        probe = SandboxLimits(
            uid=limits.uid, gid=limits.gid, wall_seconds=30, cpu_seconds=10, isolate_network=False
        )
        tried = []
        for candidate in dict.fromkeys(c for c in candidates if c and os.path.exists(c)):
            result = _run("", probe, drop, candidate)
            if result.exit_code == 0:
                _INTERPRETERS[key] = candidate
                return candidate
            tried.append(
                f"{candidate} ({result.summary}{': ' + result.stderr.strip() if result.stderr else ''})"
            )
        raise SandboxError(
            f"no Python interpreter that uid {limits.uid} can run: tried {', '.join(tried) or 'none found'}. "
            "Set SandboxLimits.python to one it can (a system python3 outside /root)."
        )


def _run(code: str, limits: SandboxLimits, drop: bool, python: str) -> SandboxResult:
    try:
        workdir = sandbox_dirs.make_workdir(code, (limits.uid, limits.gid) if drop else None)
    except sandbox_dirs.WorkdirError as exc:
        raise SandboxError(str(exc)) from exc
    cgroup = cgroups.create(os.path.basename(workdir), limits.memory_bytes, limits.max_processes)
    try:
        return _execute(workdir, limits, drop, python, cgroup)
    finally:
        if isinstance(cgroup, cgroups.SandboxCgroup):
            cgroup.remove()
        sandbox_dirs.remove_tree(workdir)


def per_process_limits(limits: SandboxLimits) -> tuple[int, int]:
    """(RLIMIT_AS, RLIMIT_NPROC) where no cgroup bounds the total: processes x address space <= the memory
    budget, each process with at least ``MIN_PROCESS_ADDRESS_SPACE`` (or the whole budget, if smaller)."""
    processes = max(1, min(limits.max_processes, limits.memory_bytes // MIN_PROCESS_ADDRESS_SPACE))
    return limits.memory_bytes // processes, processes


_SECCOMP_FILTER = user_namespace_filter()


def _execute(
    workdir: str, limits: SandboxLimits, drop: bool, python: str, cgroup: cgroups.SandboxCgroup | str
) -> SandboxResult:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    status_read, status_write = os.pipe()
    address_space, processes = per_process_limits(limits)
    config = {
        "status_fd": status_write,
        "parent_pid": os.getpid(),
        "workdir": workdir,
        "python": python,
        "argv": [python, "-I", "-S", "-B", "-u", "-c", RUNNER],
        "env": {**env, "HOME": workdir, "TMPDIR": workdir},
        "uid": limits.uid if drop else None,
        "gid": limits.gid if drop else None,
        "cpu_seconds": int(limits.cpu_seconds),
        "wall_seconds": float(limits.wall_seconds),
        "memory_bytes": int(limits.memory_bytes),
        "max_processes": int(limits.max_processes),
        "fallback_address_space": address_space,
        "fallback_processes": processes,
        "cgroup_procs": cgroup.procs_files if isinstance(cgroup, cgroups.SandboxCgroup) else [],
        "file_size_bytes": int(limits.file_size_bytes),
        "disk_bytes": int(limits.disk_bytes),
        "disk_inodes": max(MIN_INODES, limits.disk_bytes // BYTES_PER_INODE),
        "max_open_files": int(limits.max_open_files),
        "seccomp": None if _SECCOMP_FILTER is None else _SECCOMP_FILTER.hex(),
        "isolate_network": limits.isolate_network,
        "namespaces": limits.namespaces,
        "require_isolation": limits.require_isolation,
    }
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", BOOTSTRAP_LOADER, str(BOOTSTRAP), json.dumps(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=env,
            start_new_session=True,
            pass_fds=(status_write,),
        )
    except OSError as exc:
        os.close(status_read)
        os.close(status_write)
        raise SandboxError(f"could not start the sandbox ({sys.executable}): {exc}") from exc
    os.close(status_write)
    try:
        collected = _collect(proc, status_read, limits, start)
    finally:
        _kill_group(proc)
        os.close(status_read)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()
    duration = time.monotonic() - start
    if isinstance(cgroup, cgroups.SandboxCgroup):
        return _result(collected, limits, drop, duration, cgroup.oom_killed(), None)
    return _result(collected, limits, drop, duration, False, cgroup)


@dataclass
class _Collected:
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    events: list[dict[str, object]] = field(default_factory=list)
    truncated: bool = False
    backstop: bool = False  # the bootstrap itself had to be killed


def _collect(
    proc: subprocess.Popen[bytes], status_fd: int, limits: SandboxLimits, start: float
) -> _Collected:
    """Reads stdout, stderr and the status pipe until they close (or the backstop fires)."""
    assert proc.stdout is not None and proc.stderr is not None
    out = _Collected()
    buffers = {proc.stdout.fileno(): out.stdout, proc.stderr.fileno(): out.stderr}
    pending = b""
    total = 0
    backstop = start + limits.wall_seconds + BACKSTOP_SECONDS
    exited_at: float | None = None
    with selectors.DefaultSelector() as selector:
        for fd in (*buffers, status_fd):
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            now = time.monotonic()
            if now >= backstop:
                out.backstop = True
                return out
            if exited_at is not None and now - exited_at >= DRAIN_SECONDS:
                return out
            deadline = backstop if exited_at is None else min(backstop, exited_at + DRAIN_SECONDS)
            for key, _ in selector.select(max(0.0, deadline - now)):
                fd = key.fd
                chunk = os.read(fd, 65536)
                if not chunk:
                    selector.unregister(fd)
                    continue
                if fd == status_fd:
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        event = _parse_event(line)
                        out.events.append(event)
                        if event.get("event") in ("exit", "error") and exited_at is None:
                            exited_at = time.monotonic()
                    continue
                room = limits.max_output_bytes - total
                if room > 0:
                    buffers[fd] += chunk[:room]
                total += len(chunk)
                if total > limits.max_output_bytes and not out.truncated:
                    out.truncated = (
                        True  # the bootstrap kills the code; keep reading (and dropping) until EOF
                    )
                    _signal(proc, signal.SIGTERM)
                    backstop = min(backstop, time.monotonic() + BACKSTOP_SECONDS)
    return out


def _parse_event(line: bytes) -> dict[str, object]:
    try:
        event = json.loads(line)
    except ValueError:
        return {"event": "garbled", "text": line.decode(errors="replace")}
    return event if isinstance(event, dict) else {"event": "garbled", "text": repr(event)}


def _strings(value: object) -> list[str]:
    return [str(item) for item in value] if isinstance(value, list) else []


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kills the bootstrap's whole process group (stragglers included) and reaps the bootstrap."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL does not fail
        proc.wait(timeout=10)


def _isolation(
    by_kind: dict[object, dict[str, object]], limits: SandboxLimits, drop: bool, cgroup_note: str | None
) -> Isolation:
    """What the bootstrap and its child reported enforcing."""
    isolation_event = by_kind.get("isolation", {})
    child = by_kind.get("child")
    notes = [*_strings(isolation_event.get("notes")), *_strings((child or {}).get("unenforced"))]
    moved = by_kind.get("cgroup")  # the parent's report of moving the child into the cgroup, if it tried
    notes += _strings((moved or {}).get("notes"))
    memory: MemoryBound = "none"
    if child is not None:
        memory = "cgroup" if moved is not None and moved.get("joined") is True else "per-process"
    if memory != "cgroup" and cgroup_note is not None:
        notes.append(cgroup_note)
    limits_set = moved or child or {}  # a failed move lowered the child's limits to the fallback's
    address_space, processes = limits_set.get("address_space"), limits_set.get("max_processes")
    child = child or {}
    return Isolation(
        uid=limits.uid if drop else None,
        network=isolation_event.get("network") is True,
        pid_namespace=isolation_event.get("pid_namespace") is True,
        filesystem=isolation_event.get("filesystem") is True,
        disk="tmpfs" if isolation_event.get("disk") == "tmpfs" else "per-file",
        memory=memory,
        address_space_bytes=address_space if isinstance(address_space, int) else None,
        max_processes=processes if isinstance(processes, int) else None,
        user_namespaces_blocked=child.get("user_namespaces_blocked") is True,
        notes=tuple(notes),
    )


def _cpu_limit_hit(
    limits: SandboxLimits,
    isolation: Isolation,
    killed: object,
    signal_number: int | None,
    cpu_seconds: float,
    oom_killed: bool,
) -> bool:
    """Whether RLIMIT_CPU killed the code. The kernel enforces it on tick-sampled CPU time, which on a busy
    virtual machine runs ahead of the precise time that ``wait4`` reports (0.8 s reported for a 1 s limit):
    where the code was PID 1 of its own PID namespace, nothing inside could send it SIGKILL, so a SIGKILL
    that neither the bootstrap (``killed``) nor the OOM killer sent needs only half the limit as evidence."""
    if killed is not None or oom_killed or signal_number not in (signal.SIGKILL, signal.SIGXCPU):
        return False
    if isolation.pid_namespace:
        return cpu_seconds >= CPU_EVIDENCE_FRACTION * limits.cpu_seconds
    return cpu_seconds >= limits.cpu_seconds - 0.05


def _result(
    collected: _Collected,
    limits: SandboxLimits,
    drop: bool,
    duration: float,
    oom_killed: bool,
    cgroup_note: str | None,
) -> SandboxResult:
    by_kind: dict[object, dict[str, object]] = {}
    for event in collected.events:
        by_kind.setdefault(event.get("event"), event)
    isolation = _isolation(by_kind, limits, drop, cgroup_note)
    error_event = by_kind.get("error")
    if error_event is not None and str(error_event.get("message", "")).startswith("isolation required"):
        raise SandboxError(str(error_event["message"]))
    exit_event = by_kind.get("exit", {})
    returncode = exit_event.get("returncode")
    signal_number = exit_event.get("signal")
    cpu = exit_event.get("cpu_seconds", 0.0)
    cpu_seconds = float(cpu) if isinstance(cpu, int | float) else 0.0
    killed = exit_event.get("killed")
    error = None
    if error_event is not None:
        error = str(error_event.get("message"))
    elif not exit_event and not collected.truncated:
        error = "the sandbox ended without reporting an exit status" + (
            " (killed after the wall-clock limit)" if collected.backstop else ""
        )
    stderr = collected.stderr.decode(errors="replace")
    exit_code = returncode if isinstance(returncode, int) else None
    signal_value = signal_number if isinstance(signal_number, int) else None
    last_line = stderr.rstrip().rsplit("\n", 1)[-1]
    memory_error = exit_code not in (0, None) and last_line.startswith("MemoryError")
    return SandboxResult(
        stdout=collected.stdout.decode(errors="replace"),
        stderr=stderr,
        exit_code=exit_code,
        signal_number=signal_value,
        timed_out=killed == "wall" or (collected.backstop and not collected.truncated),
        cpu_limit_exceeded=_cpu_limit_hit(limits, isolation, killed, signal_value, cpu_seconds, oom_killed),
        memory_limit_exceeded=oom_killed or memory_error,
        truncated=collected.truncated,
        duration_seconds=duration,
        cpu_seconds=cpu_seconds,
        isolation=isolation,
        limits=limits,
        error=error,
    )
