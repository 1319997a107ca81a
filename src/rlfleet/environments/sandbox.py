"""Runs untrusted Python in a separate, limited, isolated process: :func:`run_python`.

Not ``exec`` with trimmed builtins. Each call gets:

* a new process (``python -I -S -u``: no environment variables, no user site, no site-packages; the stdlib
  only), started through :mod:`rlfleet.environments._bootstrap` in a new session;
* resource limits (``setrlimit``, soft = hard): CPU seconds, address space, file size, number of processes,
  open files, no core files;
* as root, the unprivileged uid/gid ``SandboxLimits.uid``/``gid`` (65534, *nobody*, by default): root
  would ignore the process limit, write anywhere and signal anything; the sandbox user cannot signal the
  caller's processes nor read their ``/proc/PID/environ``;
* where the OS allows it (root, or unprivileged user namespaces): new network, IPC, PID and mount namespaces:
  no network at all, no process outside visible, every process the code started killed with it, and only
  the working directory writable (``/tmp``, ``/var/tmp``, ``/run/lock`` covered, ``/dev/shm`` private). What
  was enforced is recorded in :attr:`SandboxResult.isolation`; ``SandboxLimits.require_isolation`` refuses
  to run without it;
* a wall-clock limit (the whole PID namespace, or process group, is killed);
* a fresh temporary working directory (``HOME`` and ``TMPDIR`` too), owned by the sandbox user and removed
  afterwards, whatever happened;
* an output cap: stdout and stderr are read as they come and the process is killed once together they pass
  ``max_output_bytes``, so a flood is never buffered;
* an environment of ``PATH``, ``LANG``/``LC_ALL``, ``HOME`` and ``TMPDIR`` only: nothing of the caller's
  (``HF_TOKEN``, ``WANDB_API_KEY``, ...) reaches the code.

The code is the file ``main.py`` in the working directory, run as ``__main__``; a traceback shows its
lines. :attr:`SandboxResult.summary` is a one-line verdict (``exit code 0``, ``killed: CPU time limit of 2 s
exceeded``, ...) and :attr:`SandboxResult.observation` that line followed by the (clipped) output: the text a
tool returns to the model.

Linux only for the namespaces and the uid drop; on macOS the resource limits, wall clock, output cap,
environment and working directory apply, and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.errors import UserError

__all__ = ["Isolation", "SandboxError", "SandboxLimits", "SandboxResult", "run_python"]

BOOTSTRAP = Path(__file__).with_name("_bootstrap.py")
MAIN_FILE = "main.py"
# After the wall clock the bootstrap kills the code; this much later the caller kills the bootstrap too.
BACKSTOP_SECONDS = 5.0
# Once the code has exited, how long to wait for the pipes to close (a straggler without a PID namespace).
DRAIN_SECONDS = 0.5

# Runs the user's main.py as __main__ and prints its traceback without this runner's frames. ``-S`` skips
# the site module, which is what defines exit() and quit(): they are provided.
RUNNER = r"""
import builtins, sys
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
    memory_bytes: int = 512 * 2**20  # address space (RLIMIT_AS)
    file_size_bytes: int = 16 * 2**20  # largest file the code may write (RLIMIT_FSIZE); also /dev/shm's size
    max_processes: int = 32  # processes and threads of the sandbox uid (RLIMIT_NPROC)
    max_open_files: int = 64
    max_output_bytes: int = 64 * 2**10  # stdout + stderr; the code is killed beyond
    isolate_network: bool = True
    # network, IPC, PID and mount namespaces where the OS allows them; False: resource limits, uid drop, wall
    # clock, output cap, environment and working directory only (e.g. where a seccomp profile forbids unshare)
    namespaces: bool = True
    # refuse to run (SandboxError) unless the network (when isolated), PID and mount namespaces were created
    require_isolation: bool = False
    # the uid/gid the code runs as when the caller is root. RLIMIT_NPROC counts every process of that uid, so
    # concurrent sandboxes sharing it share the process budget: give parallel workers distinct uids.
    uid: int = 65534
    gid: int = 65534
    # the untrusted interpreter; default: this one if the sandbox uid can run it, else a system python3
    python: str | None = None
    max_observation_chars: int = 2000  # per stream in `observation` (head and tail kept)

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_bytes", "file_size_bytes", "max_processes", "max_open_files"):
            if getattr(self, name) < 1:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {getattr(self, name)}")
        if self.wall_seconds <= 0 or self.max_output_bytes < 1 or self.max_observation_chars < 1:
            raise ValueError(
                "SandboxLimits.wall_seconds, max_output_bytes and max_observation_chars must be positive"
            )


@dataclass(frozen=True)
class Isolation:
    """What was enforced beyond the resource limits, wall clock, output cap, environment and working dir."""

    uid: int | None  # the uid the code ran as; None: the caller's own (not root)
    network: bool  # new network namespace: no network
    pid_namespace: bool  # the code is PID 1 of its own PID namespace
    filesystem: bool  # private mount namespace: only the working directory (and a private /dev/shm) writable
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
    memory_limit_exceeded: bool  # a MemoryError ended the program (the address-space limit)
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
            return f"exit code {self.exit_code}: memory limit of {limits.memory_bytes // 2**20} MiB exceeded"
        if self.signal_number is not None:
            return f"killed by signal {_signal_name(self.signal_number)}"
        return f"exit code {self.exit_code}"

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
    drop = os.geteuid() == 0
    python = _interpreter(limits, drop)
    return _run(code, limits, drop, python)


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


def _make_workdir(code: str, limits: SandboxLimits, drop: bool) -> str:
    workdir = tempfile.mkdtemp(prefix="rlfleet-sandbox-")
    main = os.path.join(workdir, MAIN_FILE)
    with open(main, "w", encoding="utf-8") as f:
        f.write(code)
    os.chmod(main, 0o644)
    if drop:
        os.chown(workdir, limits.uid, limits.gid)
    return workdir


def _remove(workdir: str) -> None:
    """Removes the working directory; never raises (a directory left behind is not worth a crashed run)."""

    def make_writable(_function: object, path: str, _exc: object) -> None:
        # the code may have taken away its own permissions (only matters when not root)
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(path), stat.S_IRWXU)
            if os.path.isdir(path) and not os.path.islink(path):
                os.chmod(path, stat.S_IRWXU)
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)

    with contextlib.suppress(OSError):
        if sys.version_info >= (3, 12):
            shutil.rmtree(workdir, onexc=make_writable)
        else:
            shutil.rmtree(workdir, onerror=make_writable)
    shutil.rmtree(workdir, ignore_errors=True)


def _run(code: str, limits: SandboxLimits, drop: bool, python: str) -> SandboxResult:
    workdir = _make_workdir(code, limits, drop)
    try:
        return _execute(workdir, limits, drop, python)
    finally:
        _remove(workdir)


def _execute(workdir: str, limits: SandboxLimits, drop: bool, python: str) -> SandboxResult:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    status_read, status_write = os.pipe()
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
        "file_size_bytes": int(limits.file_size_bytes),
        "max_processes": int(limits.max_processes),
        "max_open_files": int(limits.max_open_files),
        "isolate_network": limits.isolate_network,
        "namespaces": limits.namespaces,
        "require_isolation": limits.require_isolation,
    }
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(BOOTSTRAP), json.dumps(config)],
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
    return _result(collected, limits, drop, time.monotonic() - start)


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


def _result(collected: _Collected, limits: SandboxLimits, drop: bool, duration: float) -> SandboxResult:
    by_kind: dict[object, dict[str, object]] = {}
    for event in collected.events:
        by_kind.setdefault(event.get("event"), event)
    isolation_event = by_kind.get("isolation", {})
    notes = [*_strings(isolation_event.get("notes")), *_strings(by_kind.get("child", {}).get("unenforced"))]
    isolation = Isolation(
        uid=limits.uid if drop else None,
        network=bool(isolation_event.get("network")),
        pid_namespace=bool(isolation_event.get("pid_namespace")),
        filesystem=bool(isolation_event.get("filesystem")),
        notes=tuple(notes),
    )
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
    return SandboxResult(
        stdout=collected.stdout.decode(errors="replace"),
        stderr=stderr,
        exit_code=exit_code,
        signal_number=signal_value,
        timed_out=killed == "wall" or (collected.backstop and not collected.truncated),
        cpu_limit_exceeded=killed is None
        and signal_value in (signal.SIGKILL, signal.SIGXCPU)
        and cpu_seconds >= limits.cpu_seconds - 0.05,
        memory_limit_exceeded=exit_code not in (None, 0) and last_line.startswith("MemoryError"),
        truncated=collected.truncated,
        duration_seconds=duration,
        cpu_seconds=cpu_seconds,
        isolation=isolation,
        limits=limits,
        error=error,
    )
