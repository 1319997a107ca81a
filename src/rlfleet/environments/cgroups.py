"""A cgroup per sandbox: one bound on the memory and the processes of all that the sandboxed code starts.

Resource limits bound each process; a cgroup bounds them together. :func:`create` makes one for a
:func:`~rlfleet.environments.sandbox.run_python` call, where the caller may:

* **cgroup v2** (one hierarchy): ``memory.max`` (the budget), ``memory.swap.max`` = 0 and ``pids.max``. A
  cgroup can hand the memory controller to children only while it holds no process of its own, so the
  sandboxes' cgroups go in the first of these whose children get ``memory`` and ``pids``: the caller's own
  cgroup (only when it may enable them for its children: the root of the hierarchy), else its parent (the
  sandboxes then sit beside the caller: e.g. ``/system.slice`` for a root service, or a user's delegated
  ``app.slice``);
* **cgroup v1** (a hierarchy per controller): ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes``
  (no swap beyond it) under the caller's memory cgroup, ``pids.max`` under its pids cgroup.

Each is named after the sandbox's working directory (``rlfleet-sandbox-<owner>-<random>``, see
:mod:`~rlfleet.environments.sandbox_dirs`), so that :func:`sweep` can remove those of callers that died. The
bootstrap moves the sandbox's first process in (through the ``cgroup.procs`` files opened before it
unshares anything) before the untrusted code runs; :meth:`SandboxCgroup.remove` kills whatever is left in
it and removes it. Anything that fails returns a reason instead, and the sandbox falls back to per-process
limits: never an error.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlfleet.environments.sandbox_dirs import PREFIX

__all__ = ["Placement", "SandboxCgroup", "create", "placement", "sweep"]

# How long remove() waits for the killed processes to leave a cgroup before leaving it to the next sweep.
REMOVE_ATTEMPTS = 200
REMOVE_PAUSE_SECONDS = 0.005
SWAP_FILES = ("memory.swap.max", "memory.memsw.limit_in_bytes")


@dataclass(frozen=True)
class Placement:
    """Where sandboxes' cgroups are made: v2, one base directory; v1, a memory and a pids one."""

    version: int
    bases: tuple[Path, ...]


@dataclass(frozen=True)
class SandboxCgroup:
    """One sandbox's cgroup: a directory per hierarchy (one for v2; memory then pids for v1)."""

    version: int
    dirs: tuple[Path, ...]

    @property
    def procs_files(self) -> list[str]:
        """The files the bootstrap writes the sandbox's first process's PID to, to move it in."""
        return [str(path / "cgroup.procs") for path in self.dirs]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process in it for want of memory (its memory events' ``oom_kill``)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            for line in (self.dirs[0] / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value) > 0
        return False

    def remove(self, attempts: int = REMOVE_ATTEMPTS) -> bool:
        """Kills every process left in it and removes it, waiting up to ``attempts`` pauses for the killed to
        go; never raises. False: something stayed (the next :func:`sweep` tries again)."""
        for attempt in range(attempts):
            for path in self.dirs:
                if path.exists():
                    _kill_all(path)
                    with contextlib.suppress(OSError):
                        path.rmdir()
            if not any(path.exists() for path in self.dirs):
                return True
            if attempt + 1 < attempts:
                time.sleep(REMOVE_PAUSE_SECONDS)
        _LEFT_BEHIND.add(self)
        return False


# cgroups this process failed to remove (their owner is alive, so sweep() would not see them otherwise)
_LEFT_BEHIND: set[SandboxCgroup] = set()


def _kill_all(path: Path) -> None:
    if (path / "cgroup.kill").exists():  # v2, Linux >= 5.14: every process at once, forks included
        with contextlib.suppress(OSError):
            (path / "cgroup.kill").write_text("1")
        return
    with contextlib.suppress(OSError):
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)


def create(
    name: str, memory_bytes: int, max_processes: int, where: Placement | str | None = None
) -> SandboxCgroup | str:
    """A new cgroup ``name`` bounding the memory and the processes of a sandbox, or why there is none.
    ``where``: default :func:`placement`."""
    where = placement() if where is None else where
    if isinstance(where, str):
        return where
    dirs = tuple(base / name for base in where.bases)
    made: list[Path] = []
    try:
        for path in dirs:
            path.mkdir(mode=0o755)
            made.append(path)
        if where.version == 2:
            _write(dirs[0], "memory.max", memory_bytes)
            _write(dirs[0], "memory.swap.max", 0)
            _write(dirs[0], "pids.max", max_processes)
        else:
            _write(dirs[0], "memory.limit_in_bytes", memory_bytes)
            _write(dirs[0], "memory.memsw.limit_in_bytes", memory_bytes)  # memory + swap: no swap beyond
            _write(dirs[1], "pids.max", max_processes)
    except OSError as exc:
        SandboxCgroup(where.version, tuple(made)).remove()
        return f"cgroup v{where.version} under {where.bases[0]}: {exc}"
    return SandboxCgroup(where.version, dirs)


def _write(path: Path, name: str, value: int) -> None:
    try:
        (path / name).write_text(str(value))
    except FileNotFoundError as exc:
        if name in SWAP_FILES and not _swap_in_use():
            return  # no swap accounting, and no swap to bound
        raise OSError(exc.errno, f"{name} is missing (the kernel does not offer it)") from exc


def _swap_in_use() -> bool:
    try:
        return len(Path("/proc/swaps").read_text().strip().splitlines()) > 1  # a header, then the devices
    except OSError:
        return True


def sweep(owner_alive: Callable[[str], bool]) -> None:
    """Removes the sandboxes' cgroups whose owner (see ``owner_alive``, given a cgroup's name) is gone."""
    for left in list(_LEFT_BEHIND):
        _LEFT_BEHIND.discard(left)
        left.remove(attempts=1)
    where = placement()
    if isinstance(where, str):
        return
    for base in where.bases:
        with contextlib.suppress(OSError):
            for entry in os.listdir(base):
                if entry.startswith(PREFIX) and not owner_alive(entry):
                    SandboxCgroup(where.version, (base / entry,)).remove(attempts=1)


@functools.cache
def placement(
    mountinfo: str = "/proc/self/mountinfo", membership: str = "/proc/self/cgroup"
) -> Placement | str:
    """Where this process may make sandboxes' cgroups (found once), or why nowhere. The arguments are the
    files read (a test passes fakes)."""
    try:
        mounts = _cgroup_mounts(Path(mountinfo).read_text())
        groups = _memberships(Path(membership).read_text())
    except OSError as exc:
        return f"no cgroups here ({exc})"
    reasons = []
    for version in (2, 1):
        found = _placement_v2(mounts, groups) if version == 2 else _placement_v1(mounts, groups)
        if isinstance(found, Placement):
            return found
        reasons.append(found)
    return "; ".join(reasons)


def _cgroup_mounts(mountinfo: str) -> dict[str, tuple[Path, str]]:
    """``"2"`` and each v1 controller (``"memory"``, ``"pids"``) -> (mount point, root of the mount)."""
    mounts: dict[str, tuple[Path, str]] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype, _, options = line.split(" - ", 1)[1].split()[:3]
        point = Path(fields[4].replace("\\040", " "))
        if fstype == "cgroup2":
            mounts.setdefault("2", (point, fields[3]))
        elif fstype == "cgroup":
            for controller in ("memory", "pids"):
                if controller in options.split(","):
                    mounts.setdefault(controller, (point, fields[3]))
    return mounts


def _memberships(text: str) -> dict[str, str]:
    """``"2"`` and each v1 controller -> this process's cgroup path (``/proc/self/cgroup``)."""
    groups: dict[str, str] = {}
    for line in text.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            groups["2"] = path
        for controller in controllers.split(","):
            if controller in ("memory", "pids"):
                groups[controller] = path
    return groups


def _own_dir(mounts: dict[str, tuple[Path, str]], groups: dict[str, str], key: str) -> Path | None:
    if key not in mounts or key not in groups:
        return None
    point, root = mounts[key]
    path = groups[key]
    if root != "/" and not (path == root or path.startswith(root.rstrip("/") + "/")):
        return None  # this process's cgroup is not inside that mount
    relative = path[len(root) :] if root != "/" else path
    return point / relative.lstrip("/")


def _placement_v2(mounts: dict[str, tuple[Path, str]], groups: dict[str, str]) -> Placement | str:
    own = _own_dir(mounts, groups, "2")
    if own is None:
        return "cgroup v2: not mounted, or this process's cgroup is not in it"
    wanted = {"memory", "pids"}
    if wanted <= _words(own / "cgroup.subtree_control"):
        return Placement(2, (own,))
    if wanted <= _words(own / "cgroup.controllers"):  # its parent hands them to its children
        if os.access(own, os.W_OK):
            with contextlib.suppress(OSError):  # allowed at the root of the hierarchy only (it has processes)
                (own / "cgroup.subtree_control").write_text("+memory +pids")
                return Placement(2, (own,))
        if own != mounts["2"][0] and os.access(own.parent, os.W_OK):
            return Placement(2, (own.parent,))
    return (
        f"cgroup v2: {own} cannot give its children the memory and pids controllers, nor can its parent "
        "(not enabled, or not this user's); to bound the sandbox's total memory, start the trainer where "
        "its cgroup's parent is delegated to it (e.g. in a systemd user session: systemd-run --user --scope)"
    )


def _placement_v1(mounts: dict[str, tuple[Path, str]], groups: dict[str, str]) -> Placement | str:
    memory, pids = _own_dir(mounts, groups, "memory"), _own_dir(mounts, groups, "pids")
    if memory is None or pids is None:
        return "cgroup v1: no memory and pids hierarchies"
    if not (os.access(memory, os.W_OK) and os.access(pids, os.W_OK)):
        return f"cgroup v1: {memory} and {pids} are not writable by this user"
    return Placement(1, (memory, pids))


def _words(path: Path) -> set[str]:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()
