"""The sandbox's first process: isolates, limits, drops privileges, then runs the untrusted interpreter.

:func:`rlfleet.environments.sandbox.run_python` starts this file as ``python -I -S _bootstrap.py CONFIG``
(stdlib only, nothing from the caller's environment), in a new session whose working directory is the
run's fresh temporary directory. It is trusted code and runs with the caller's privileges:

1. ``prctl(PR_SET_PDEATHSIG)``: if the caller dies, this process is told to stop and kills the sandbox.
2. Namespaces, each where the OS permits it (root, or an unprivileged user namespace): a new network
   namespace (no interface but a down loopback: no network at all), a new IPC namespace, a new PID
   namespace (the untrusted code is its PID 1; killing it kills every process the code started, and no
   process outside is visible), and a new mount namespace with private propagation in which the
   world-writable directories (``/tmp``, ``/var/tmp``, ``/run/lock``) are covered by empty read-only
   tmpfs, ``/dev/shm`` by a small private one, and the working directory is bound back at its path.
3. ``fork``: the child mounts a ``/proc`` of its own PID namespace, sets the resource limits, drops to the
   sandbox uid/gid (when started as root), and ``execve``-s the untrusted interpreter with a minimal
   environment. The parent enforces the wall-clock limit (``SIGKILL`` to the child: with a PID namespace
   that ends all of its processes) and reports the child's exit status and CPU time.

Events go to the caller as JSON lines on the status file descriptor (``status_fd``); the child's stdout
and stderr are the caller's pipes.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1

# World-writable directories covered in the sandbox's mount namespace by an empty read-only tmpfs each;
# /dev/shm gets a small writable private tmpfs instead: POSIX semaphores (multiprocessing's locks) live there.
READ_ONLY_DIRS = ("/tmp", "/var/tmp", "/run/lock")
SHM_DIR = "/dev/shm"

_state: dict[str, Any] = {"child": None, "killed": None}


def _report(fd: int, **event: Any) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, (json.dumps(event) + "\n").encode())


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.unshare.argtypes = [ctypes.c_int]
        libc.mount.argtypes = [
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_ulong,
            ctypes.c_char_p,
        ]
        libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        return libc
    except (OSError, AttributeError):  # no libc symbols (not Linux): no namespaces
        return None


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _unshare(libc: ctypes.CDLL | None, flag: int, notes: list[str], what: str) -> bool:
    if libc is None:
        return False
    try:
        _check(libc.unshare(flag), f"unshare({what})")
        return True
    except OSError as exc:
        notes.append(str(exc))
        return False


def _mount(
    libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    def encode(text: str | None) -> bytes | None:
        return None if text is None else text.encode()

    result = libc.mount(encode(source), target.encode(), encode(fstype), flags, encode(data))
    _check(result, f"mount {target}")


def _user_namespace(libc: ctypes.CDLL | None, notes: list[str]) -> bool:
    """Not root: an unprivileged user namespace mapping the caller's uid/gid to themselves (the capabilities
    it grants end at ``execve``, as the mapped uid is not 0)."""
    uid, gid = os.getuid(), os.getgid()
    if not _unshare(libc, CLONE_NEWUSER, notes, "CLONE_NEWUSER"):
        return False
    try:
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError as exc:
        notes.append(f"user namespace maps: {exc}")
        return False
    return True


def _private_filesystem(libc: ctypes.CDLL | None, workdir: str, shm_bytes: int, notes: list[str]) -> bool:
    """A mount namespace with private propagation where only the working directory (and a private /dev/shm)
    is writable by the sandbox user. All or nothing: a partial set-up is undone."""
    if libc is None or not _unshare(libc, CLONE_NEWNS, notes, "CLONE_NEWNS"):
        return False
    try:  # nothing below may propagate to the caller's mount namespace
        _mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None)
    except OSError as exc:
        notes.append(str(exc))
        return False
    mounted: list[str] = []
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    try:
        workdir_fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
        for path in READ_ONLY_DIRS:
            if os.path.isdir(path) and not os.path.islink(path):
                _mount(libc, "tmpfs", path, "tmpfs", flags, "size=65536,mode=0755")
                mounted.append(path)
        if os.path.isdir(SHM_DIR) and not os.path.islink(SHM_DIR):
            _mount(libc, "tmpfs", SHM_DIR, "tmpfs", flags, f"size={shm_bytes},mode=1777")
            mounted.append(SHM_DIR)
        os.makedirs(workdir, exist_ok=True)  # the mount point, when the directory was under a covered one
        _mount(libc, f"/proc/self/fd/{workdir_fd}", workdir, None, MS_BIND | MS_REC, None)
        mounted.append(workdir)
        for path in READ_ONLY_DIRS:  # read-only once the mount point exists (a user namespace owns them)
            if path in mounted:
                _mount(libc, None, path, None, MS_REMOUNT | MS_RDONLY | flags, None)
        os.chdir(workdir)
        os.close(workdir_fd)
        return True
    except OSError as exc:
        notes.append(str(exc))
        for path in reversed(mounted):
            libc.umount2(path.encode(), MNT_DETACH)
        return False


def _set_limits(cfg: dict[str, Any]) -> list[str]:
    failed = []
    limits = [
        ("RLIMIT_CPU", cfg["cpu_seconds"]),  # soft = hard: SIGKILL at the limit (PID 1 ignores SIGXCPU)
        ("RLIMIT_AS", cfg["memory_bytes"]),
        ("RLIMIT_FSIZE", cfg["file_size_bytes"]),
        ("RLIMIT_NPROC", cfg["max_processes"]),
        ("RLIMIT_NOFILE", cfg["max_open_files"]),
        ("RLIMIT_CORE", 0),
    ]
    for name, value in limits:
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (AttributeError, ValueError, OSError) as exc:
            failed.append(f"{name}: {exc}")
    return failed


def _child(cfg: dict[str, Any], libc: ctypes.CDLL | None, pid_namespace: bool, private_fs: bool) -> None:
    """The forked child (PID 1 of the new PID namespace when there is one): never returns."""
    status_fd = cfg["status_fd"]
    try:
        for sig in (signal.SIGTERM, signal.SIGALRM, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        proc_mounted = False
        if libc is not None and pid_namespace and private_fs:
            try:  # a /proc showing this PID namespace only
                _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
                proc_mounted = True
            except OSError:
                pass
        failed = _set_limits(cfg)
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
        if libc is not None:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _report(status_fd, event="child", proc=proc_mounted, unenforced=failed)
        os.execve(cfg["python"], cfg["argv"], cfg["env"])
    except BaseException as exc:
        _report(status_fd, event="error", message=f"could not start {cfg['python']}: {exc}")
    os._exit(127)


def _kill_child(reason: str) -> None:
    if _state["killed"] is None:
        _state["killed"] = reason
    if _state["child"] is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(_state["child"], signal.SIGKILL)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    status_fd: int = cfg["status_fd"]
    os.set_inheritable(status_fd, False)  # the child may write to it, the untrusted program gets no copy
    libc = _libc()
    signal.signal(signal.SIGTERM, lambda *_: _kill_child("caller"))
    signal.signal(signal.SIGALRM, lambda *_: _kill_child("wall"))
    if libc is not None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != cfg["parent_pid"]:
        return  # the caller is already gone

    notes: list[str] = []
    privileged = os.geteuid() == 0
    if not cfg["namespaces"]:
        isolated = False
        notes.append("namespaces disabled (SandboxLimits.namespaces=False)")
    else:
        isolated = privileged or _user_namespace(libc, notes)
    network = isolated and cfg["isolate_network"] and _unshare(libc, CLONE_NEWNET, notes, "CLONE_NEWNET")
    if isolated:
        _unshare(libc, CLONE_NEWIPC, notes, "CLONE_NEWIPC")
    pid_namespace = isolated and _unshare(libc, CLONE_NEWPID, notes, "CLONE_NEWPID")
    private_fs = isolated and _private_filesystem(libc, cfg["workdir"], cfg["file_size_bytes"], notes)
    _report(
        status_fd,
        event="isolation",
        network=network,
        pid_namespace=pid_namespace,
        filesystem=private_fs,
        notes=notes,
    )
    if cfg["require_isolation"] and not (
        pid_namespace and private_fs and (network or not cfg["isolate_network"])
    ):
        _report(status_fd, event="error", message="isolation required but not available: " + "; ".join(notes))
        return

    signal.setitimer(signal.ITIMER_REAL, cfg["wall_seconds"])
    pid = os.fork()
    if pid == 0:
        _child(cfg, libc, pid_namespace, private_fs)
    _state["child"] = pid
    if _state["killed"] is not None:  # a signal arrived between fork and the line above
        _kill_child(_state["killed"])
    _, status, usage = os.wait4(pid, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    _report(
        status_fd,
        event="exit",
        returncode=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        cpu_seconds=usage.ru_utime + usage.ru_stime,
        killed=_state["killed"],
    )


if __name__ == "__main__":
    main()
