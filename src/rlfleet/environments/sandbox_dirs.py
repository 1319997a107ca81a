"""The sandbox's working directories, named after the process that made them and swept once it is gone.

A caller removes its working directory when the run ends, whatever happened to the code; a caller that is
itself killed (``SIGKILL``, the OOM killer, a node drained) cannot. So every working directory sits in one
directory of the caller's user, ``<tmp>/rlfleet-sandboxes-<euid>`` (mode 0711: others may not list it), and
is named ``rlfleet-sandbox-<owner>-<random>``, where the owner is the caller's PID namespace, PID and start
time (a recycled PID is not mistaken for its predecessor). :func:`sweep_workdirs` removes those whose owner is
gone; :func:`owner_alive` tells, from such a name, whether its owner still runs (the sandboxes' cgroups use
the same names). Where ``/proc`` is missing (macOS) the owner is the PID alone.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import stat
import sys
import tempfile

from rlfleet.errors import UserError

__all__ = ["PREFIX", "WorkdirError", "make_workdir", "owner_alive", "remove_tree", "sweep_workdirs"]

PREFIX = "rlfleet-sandbox-"
MAIN_FILE = "main.py"


class WorkdirError(RuntimeError, UserError):
    """The directory of the working directories is not this user's alone."""


@functools.cache
def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat``, field 22); None: no such
    process; 0: unknown here (no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except FileNotFoundError:
        return None if os.path.isdir("/proc/self") else 0
    except OSError:
        return 0
    return int(text.rsplit(b")", 1)[1].split()[19])  # fields after the command name start at field 3


def _owner() -> str:
    pid = os.getpid()
    return f"{_pid_namespace()}-{pid}-{_start_time(pid) or 0}"


def owner_alive(name: str) -> bool:
    """Whether the process that made ``rlfleet-sandbox-<owner>-<random>`` still runs; True when unknown (a
    name of another form, or of another PID namespace)."""
    parts = name.removeprefix(PREFIX).split("-")
    if not name.startswith(PREFIX) or len(parts) != 4 or not all(p.isdigit() for p in parts[:3]):
        return True
    namespace, pid, start = (int(p) for p in parts[:3])
    if namespace != _pid_namespace():
        return True
    now = _start_time(pid)
    if now is None:
        return False
    if now and start:
        return now == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parent() -> str:
    """``<tmp>/rlfleet-sandboxes-<euid>``, made if missing; refused unless it is this user's alone."""
    euid = os.geteuid()
    path = os.path.join(tempfile.gettempdir(), f"rlfleet-sandboxes-{euid}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o711)
        os.chmod(path, 0o711)  # whatever the umask: the sandbox user must be able to enter its own directory
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != euid or info.st_mode & 0o022:
        raise WorkdirError(
            f"{path} must be a directory of uid {euid} that no one else may write (it is "
            f"{stat.filemode(info.st_mode)}, uid {info.st_uid}): remove it, or set TMPDIR elsewhere"
        )
    return path


def make_workdir(code: str, owner: tuple[int, int] | None) -> str:
    """A fresh working directory holding ``code`` as ``main.py``, given to ``owner`` (uid, gid) if set."""
    workdir = tempfile.mkdtemp(prefix=f"{PREFIX}{_owner()}-", dir=_parent())
    main = os.path.join(workdir, MAIN_FILE)
    with open(main, "w", encoding="utf-8") as f:
        f.write(code)
    os.chmod(main, 0o644)
    if owner is not None:
        os.chown(workdir, *owner)
    return workdir


def sweep_workdirs() -> None:
    """Removes the working directories of this user's callers that are gone."""
    with contextlib.suppress(OSError):
        parent = _parent()
        for entry in os.listdir(parent):
            if entry.startswith(PREFIX) and not owner_alive(entry):
                remove_tree(os.path.join(parent, entry))


def remove_tree(path: str) -> None:
    """Removes a working directory; never raises (a directory left behind is not worth a crashed run)."""

    def make_writable(_function: object, failed: str, _exc: object) -> None:
        # the code may have taken away its own permissions (only matters when not root)
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(failed), stat.S_IRWXU)
            if os.path.isdir(failed) and not os.path.islink(failed):
                os.chmod(failed, stat.S_IRWXU)
                shutil.rmtree(failed, ignore_errors=True)
            else:
                os.unlink(failed)

    with contextlib.suppress(OSError):
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=make_writable)
        else:
            shutil.rmtree(path, onerror=make_writable)
    shutil.rmtree(path, ignore_errors=True)
