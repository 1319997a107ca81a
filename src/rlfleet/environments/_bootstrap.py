"""The sandbox's first process: isolates, limits, drops privileges, then runs the untrusted interpreter.

:func:`rlfleet.environments.sandbox.run_python` loads this file in ``python -I -S`` (stdlib only, nothing
from the caller's environment; through ``importlib``, so that its bytecode is cached) and calls
:func:`main` with the run's configuration, in a new session whose working directory is the run's fresh
working directory. It is trusted code and runs with the caller's privileges:

1. ``prctl(PR_SET_PDEATHSIG)``: if the caller dies, this process is told to stop and kills the sandbox.
2. The ``cgroup.procs`` files of the sandbox's cgroup (made by the caller, when it could) are opened now,
   before anything below can take the right to.
3. Namespaces, each where the OS permits it (root, or an unprivileged user namespace mapping the caller's
   uid to itself): a new network namespace (no interface but a down loopback: no network at all), a new IPC
   namespace, a new PID namespace (the untrusted code is its PID 1; killing it kills every process the code
   started, and no process outside is visible), and a new mount namespace with private propagation in
   which (a) a tmpfs of ``disk_bytes`` (and ``disk_inodes``) is mounted on the working directory, holding
   the working directory, ``/tmp`` (also ``/var/tmp``) and ``/dev/shm``; (b) every mount is made read-only
   (``mount_setattr(AT_RECURSIVE, MOUNT_ATTR_RDONLY)`` on ``/``, or, before Linux 5.12, a read-only bind
   remount of each mount point listed in ``/proc/self/mountinfo``); (c) the tmpfs is made writable again
   and its three directories bound at their places. The tmpfs is the one writable place, for root and
   non-root callers alike, and it vanishes with the namespace.
4. ``fork``: the child mounts a ``/proc`` of its own PID namespace, sets the resource limits, drops to the
   sandbox uid/gid (when started as root), installs the seccomp filter that refuses new user namespaces
   (:mod:`rlfleet.environments.seccomp`; with ``PR_SET_NO_NEW_PRIVS``), and ``execve``-s the untrusted
   interpreter with a minimal environment. Meanwhile the parent moves it into the cgroup and tells the
   runner (which waits for that before it runs the code) whether it is in, or must lower its limits to the
   per-process fallback's. The parent enforces the wall-clock limit (``SIGKILL`` to the child: with a PID
   namespace that ends all of its processes) and reports the child's exit status and CPU time.

Events go to the caller as JSON lines on the status file descriptor (``status_fd``); the child's stdout
and stderr are the caller's pipes. What each step achieved is reported, never assumed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
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
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
PR_SET_PDEATHSIG = 1
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
SYS_MOUNT_SETATTR = 442  # the same number on every architecture rlfleet runs on (x86_64, aarch64)
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 1
# per-mount flags a read-only remount must repeat (inside a user namespace those set are locked)
MOUNT_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}
# the tmpfs's directories, and where each is bound ("work": the working directory itself)
TMPFS_DIRS = {"work": 0o755, "tmp": 0o1777, "shm": 0o1777}
TMPFS_BINDS = (("tmp", "/tmp"), ("tmp", "/var/tmp"), ("shm", "/dev/shm"))
MAIN_FILE = "main.py"

# userns: this process made a user namespace of its own, where it counts against the RLIMIT_NPROC of the
# sandbox's uid (RLIMIT_NPROC counts per user namespace): the sandbox's limit is raised by one for it
_state: dict[str, Any] = {"child": None, "killed": None, "userns": False}


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


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
        libc.syscall.restype = ctypes.c_long
        return libc
    except (OSError, AttributeError):  # no libc symbols (not Linux): no namespaces
        return None


def _check(result: int, what: str) -> None:
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")


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


def _open_cgroup(paths: list[str], notes: list[str]) -> list[int]:
    """The sandbox cgroup's ``cgroup.procs`` files, opened for writing now: the mount namespace makes
    ``/sys/fs/cgroup`` read-only, and the child drops its privileges before it runs the code."""
    fds: list[int] = []
    try:
        for path in paths:
            fds.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
    except OSError as exc:
        notes.append(f"cgroup: {exc}")
        for fd in fds:
            os.close(fd)
        return []
    return fds


def _private_filesystem(libc: ctypes.CDLL | None, cfg: dict[str, Any], notes: list[str]) -> tuple[bool, bool]:
    """A mount namespace in which everything is read-only but a tmpfs holding the working directory,
    ``/tmp``, ``/var/tmp`` and ``/dev/shm``. Returns (everything else read-only, the tmpfs in place)."""
    if libc is None or not _unshare(libc, CLONE_NEWNS, notes, "CLONE_NEWNS"):
        return False, False
    workdir = cfg["workdir"]
    try:  # nothing below may propagate to the caller's mount namespace
        _mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None)
        root_fd = _mount_tmpfs(libc, workdir, cfg)
    except OSError as exc:  # the working directory stays the caller's directory, writable
        notes.append(f"tmpfs working directory: {exc}")
        return False, False
    read_only = _read_only_everything(libc, notes)
    try:
        _mount(libc, None, workdir, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV, None)
        _bind_tmpfs_dirs(libc, root_fd, workdir)
        os.chdir(workdir)
    except OSError as exc:
        notes.append(f"tmpfs working directory: {exc}")
        return False, False
    finally:
        os.close(root_fd)
    return read_only, True


def _mount_tmpfs(libc: ctypes.CDLL, workdir: str, cfg: dict[str, Any]) -> int:
    """Mounts the sandbox's tmpfs on the working directory, lays out its directories with ``main.py`` in
    ``work/``; returns a descriptor of its root (the path is covered later)."""
    with open(os.path.join(workdir, MAIN_FILE), "rb") as f:
        main = f.read()
    options = f"size={cfg['disk_bytes']},nr_inodes={cfg['disk_inodes']},mode=0755"
    _mount(libc, "tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, options)
    root_fd = os.open(workdir, os.O_PATH | os.O_DIRECTORY)
    for name, mode in TMPFS_DIRS.items():
        os.mkdir(name, mode, dir_fd=root_fd)
        os.chmod(name, mode, dir_fd=root_fd)  # whatever the umask
    if cfg["uid"] is not None:
        os.chown("work", cfg["uid"], cfg["gid"], dir_fd=root_fd)
    fd = os.open(f"work/{MAIN_FILE}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=root_fd)
    try:
        os.write(fd, main)
    finally:
        os.close(fd)
    return root_fd


def _bind_tmpfs_dirs(libc: ctypes.CDLL, root_fd: int, workdir: str) -> None:
    root = f"/proc/self/fd/{root_fd}"
    for name, target in TMPFS_BINDS:
        if os.path.isdir(target) and not os.path.islink(target):
            _mount(libc, f"{root}/{name}", target, None, MS_BIND, None)
    os.makedirs(workdir, mode=0o755, exist_ok=True)  # in the new /tmp, when the working directory was in /tmp
    _mount(libc, f"{root}/work", workdir, None, MS_BIND, None)


def _read_only_everything(libc: ctypes.CDLL, notes: list[str]) -> bool:
    """Every mount of this (private) mount namespace read-only: one ``mount_setattr`` where the kernel has
    it (Linux >= 5.12), else a read-only remount of each mount point."""
    try:
        _read_only_by_mount_setattr(libc)
        return True
    except OSError as first:
        try:
            _read_only_by_walk(libc)
            return True
        except OSError as exc:
            notes.append(f"read-only file system: {first}; {exc}")
            return False


def _read_only_by_mount_setattr(libc: ctypes.CDLL) -> None:
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    result = libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        ctypes.c_char_p(b"/"),
        ctypes.c_uint(AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(result, "mount_setattr(/, AT_RECURSIVE, MOUNT_ATTR_RDONLY)")


def _mount_points() -> dict[str, int]:
    """Mount point -> the per-mount flags to keep, from ``/proc/self/mountinfo`` (the last mount at a point
    is the one its path reaches)."""
    points: dict[str, int] = {}
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # \040: a space
            options = fields[5].split(",")
            flags = sum(MOUNT_FLAGS.get(option, 0) for option in options)
            if not {"noatime", "relatime"} & set(options):  # mountinfo leaves strictatime unsaid
                flags |= MS_STRICTATIME
            points[point] = flags
    return points


def _read_only_by_walk(libc: ctypes.CDLL) -> None:
    """A read-only bind remount of every mount point; one that the code could not reach either (hidden by a
    later mount, or below a directory this user cannot enter) is passed over."""
    failed = []
    for point, flags in _mount_points().items():
        try:
            _mount(libc, None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags, None)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EINVAL, errno.EACCES):
                failed.append(str(exc))
    if failed:
        raise OSError(errno.EPERM, "read-only remount failed: " + "; ".join(failed))


def _set_limits(cfg: dict[str, Any], expect_cgroup: bool) -> list[str]:
    """The resource limits: those of the cgroup mode when the child is to be moved into one (the runner
    lowers them to the fallback's if that fails), else the per-process fallback (address space x processes
    <= the memory budget)."""
    failed = []
    limits: list[tuple[str, int]] = [
        ("RLIMIT_CPU", cfg["cpu_seconds"]),  # soft = hard: SIGKILL at the limit (PID 1 ignores SIGXCPU)
        ("RLIMIT_FSIZE", cfg["file_size_bytes"]),
        ("RLIMIT_NOFILE", cfg["max_open_files"]),
        ("RLIMIT_CORE", 0),
    ]
    if expect_cgroup:  # pids.max bounds the processes; RLIMIT_NPROC would count other sandboxes of the uid
        limits.append(("RLIMIT_AS", cfg["memory_bytes"]))
    else:
        processes = cfg["fallback_processes"] + _state["userns"]
        limits += [("RLIMIT_AS", cfg["fallback_address_space"]), ("RLIMIT_NPROC", processes)]
    for name, value in limits:
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (AttributeError, ValueError, OSError) as exc:
            failed.append(f"{name}: {exc}")
    if not expect_cgroup and cfg["uid"] is None and not _state["userns"]:
        failed.append(f"RLIMIT_NPROC counts every process of uid {os.getuid()}, the caller's included")
    return failed


def _limit(name: str) -> int | None:
    """The soft limit in force (None: unlimited, or not known here)."""
    try:
        soft = resource.getrlimit(getattr(resource, name))[0]
    except (AttributeError, ValueError, OSError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def _processes_limit() -> int | None:
    """The processes the sandbox may have under RLIMIT_NPROC (None: unlimited)."""
    limit = _limit("RLIMIT_NPROC")
    return None if limit is None else limit - _state["userns"]


def _move_into_cgroup(cfg: dict[str, Any], pid: int, fds: list[int], go_fd: int) -> None:
    """Moves the child into the sandbox's cgroup (every hierarchy of it), then tells the runner, which waits
    for this before it runs the code, whether it is in (``cgroup``) or must lower its limits to the
    fallback's (``<address space> <processes>``). Done here, while the child starts its interpreter: a move
    waits for an RCU grace period (milliseconds), which then costs no time."""
    notes = []
    joined = True
    for fd in fds:
        try:
            os.write(fd, str(pid).encode())
        except OSError as exc:
            notes.append(f"cgroup: moving the sandbox in failed: {exc}")
            joined = False
        os.close(fd)
    address_space = cfg["memory_bytes"] if joined else cfg["fallback_address_space"]
    processes = cfg["max_processes"] if joined else cfg["fallback_processes"]
    verdict = "cgroup" if joined else f"{address_space} {processes + _state['userns']}"
    with contextlib.suppress(OSError):  # the child is gone already
        os.write(go_fd, verdict.encode())
    os.close(go_fd)
    _report(
        cfg["status_fd"],
        event="cgroup",
        joined=joined,
        address_space=address_space,
        max_processes=processes,
        notes=notes,
    )


def _block_user_namespaces(libc: ctypes.CDLL | None, program_hex: str | None, notes: list[str]) -> bool:
    """Installs the seccomp filter refusing new user namespaces (after ``PR_SET_NO_NEW_PRIVS``)."""
    if libc is None or program_hex is None:
        notes.append("user namespaces: no seccomp filter for this machine")
        return False
    program = bytes.fromhex(program_hex)
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    try:
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        address = ctypes.addressof(fprog)
        _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, address, 0, 0), "prctl(PR_SET_SECCOMP)")
    except OSError as exc:
        notes.append(f"user namespaces: {exc}")
        return False
    return True


def _child(cfg: dict[str, Any], libc: ctypes.CDLL | None, proc: bool, go_fd: int | None) -> None:
    """The forked child (PID 1 of the new PID namespace when there is one): never returns. ``go_fd``: the
    pipe on which the runner waits to hear whether the parent moved this process into the cgroup."""
    status_fd = cfg["status_fd"]
    try:
        for sig in (signal.SIGTERM, signal.SIGALRM, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        proc_mounted = False
        if libc is not None and proc:
            try:  # a /proc showing this PID namespace only
                _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
                proc_mounted = True
            except OSError:
                pass
        notes = _set_limits(cfg, go_fd is not None)
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
        if libc is not None:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        blocked = _block_user_namespaces(libc, cfg["seccomp"], notes)
        argv = list(cfg["argv"])
        if go_fd is not None:
            os.set_inheritable(go_fd, True)
            argv.append(str(go_fd))
        _report(
            status_fd,
            event="child",
            proc=proc_mounted,
            address_space=_limit("RLIMIT_AS"),
            max_processes=_processes_limit(),
            user_namespaces_blocked=blocked,
            unenforced=notes,
        )
        os.execve(cfg["python"], argv, cfg["env"])
    except BaseException as exc:
        _report(status_fd, event="error", message=f"could not start {cfg['python']}: {exc}")
    os._exit(127)


def _kill_child(reason: str) -> None:
    if _state["killed"] is None:
        _state["killed"] = reason
    if _state["child"] is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(_state["child"], signal.SIGKILL)


def _isolate(cfg: dict[str, Any], libc: ctypes.CDLL | None, notes: list[str]) -> dict[str, Any]:
    """The namespaces; returns the ``isolation`` event's fields."""
    if not cfg["namespaces"]:
        isolated = False
        notes.append("namespaces disabled (SandboxLimits.namespaces=False)")
    elif os.geteuid() == 0:
        isolated = True
    else:
        isolated = _state["userns"] = _user_namespace(libc, notes)
    network = isolated and cfg["isolate_network"] and _unshare(libc, CLONE_NEWNET, notes, "CLONE_NEWNET")
    if isolated:
        _unshare(libc, CLONE_NEWIPC, notes, "CLONE_NEWIPC")
    pid_namespace = isolated and _unshare(libc, CLONE_NEWPID, notes, "CLONE_NEWPID")
    read_only, tmpfs = _private_filesystem(libc, cfg, notes) if isolated else (False, False)
    return {
        "network": network,
        "pid_namespace": pid_namespace,
        "filesystem": read_only and tmpfs,
        "disk": "tmpfs" if tmpfs else "per-file",
    }


def main(config: str) -> None:
    cfg = json.loads(config)
    status_fd: int = cfg["status_fd"]
    os.set_inheritable(status_fd, False)  # the child may write to it, the untrusted program gets no copy
    libc = _libc()
    signal.signal(signal.SIGTERM, lambda *_: _kill_child("caller"))
    signal.signal(signal.SIGALRM, lambda *_: _kill_child("wall"))
    if libc is not None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != cfg["parent_pid"]:
        return  # the caller is already gone

    os.umask(0o022)  # the directories made below must be enterable by the sandbox user
    notes: list[str] = []
    cgroup_fds = _open_cgroup(cfg["cgroup_procs"], notes)
    isolation = _isolate(cfg, libc, notes)
    _report(status_fd, event="isolation", notes=notes, **isolation)
    if cfg["require_isolation"] and not (
        isolation["pid_namespace"]
        and isolation["filesystem"]
        and (isolation["network"] or not cfg["isolate_network"])
    ):
        _report(status_fd, event="error", message="isolation required but not available: " + "; ".join(notes))
        return

    go_read, go_write = os.pipe() if cgroup_fds else (None, None)
    signal.setitimer(signal.ITIMER_REAL, cfg["wall_seconds"])
    pid = os.fork()
    if pid == 0:
        if go_write is not None:
            os.close(go_write)
        _child(cfg, libc, isolation["pid_namespace"] and isolation["disk"] == "tmpfs", go_read)
    _state["child"] = pid
    if _state["killed"] is not None:  # a signal arrived between fork and the line above
        _kill_child(_state["killed"])
    if go_read is not None and go_write is not None:
        os.close(go_read)
        _move_into_cgroup(cfg, pid, cgroup_fds, go_write)
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
    main(sys.argv[1])
