"""Which ``malloc`` a CPU training process runs on: jemalloc where one is installed, glibc's otherwise.

PyTorch's CPU tensors come from ``malloc``. Under glibc, a training pass's activations (blocks under its
adaptive mmap threshold) fragment the heap, and the blocks above it are mapped and faulted in afresh each
time: a pass peaks higher and runs slower than on jemalloc with the settings below (``benchmarks/memory.py``
compares the two, issue 20). Returning freed pages to the OS as they are freed costs more than it saves
(jemalloc's default decay, or glibc with a low mmap threshold): every block is faulted in again. So
jemalloc keeps what a pass frees for the next allocation (no decay, one arena for large blocks as for small
ones: PyTorch's own CPU launcher ``torch.backends.xeon.run_cpu`` uses the same ``MALLOC_CONF``), and
``release_free_memory`` (:mod:`rlfleet.memory.probes`) hands it all back once a training pass ends.

``LD_PRELOAD`` only takes effect when a process starts, so the ``rlfleet`` command re-executes itself once
with it set (``reexec_argv``; every command, so that ``plan`` and ``validate`` estimate for the allocator the
run will have). The library loaded, the variables are removed again so that
the processes the run starts (the vLLM engine, reward workers, Ray) keep their own allocator.
``RLFLEET_ALLOCATOR=glibc`` keeps glibc's; ``RLFLEET_ALLOCATOR=jemalloc`` insists (an error if none is
found); a path to a ``libjemalloc.so`` picks that one. The jemalloc found: Ray's wheel ships one
(``ray/core/libjemalloc.so``, installed with ``rlfleet[ray]``, ``make setup-dev`` and ``make train-smollm2``),
else the system's (Debian's ``libjemalloc2``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from rlfleet.errors import UserError

ENV = "RLFLEET_ALLOCATOR"
# set in the re-executed process: it runs on jemalloc (the path), and must not re-execute again
ACTIVE_ENV = "RLFLEET_JEMALLOC_ACTIVE"
# no decay: freed pages stay for the next allocation until release_free_memory purges them;
# oversize_threshold 0: large blocks in the same arenas as small ones (not eagerly returned)
JEMALLOC_CONF = "oversize_threshold:0,dirty_decay_ms:-1,muzzy_decay_ms:-1,background_thread:false"
MALLCTL_ARENAS_ALL = 4096  # jemalloc's "all arenas" index in mallctl names


class AllocatorError(UserError):
    """``RLFLEET_ALLOCATOR`` names an allocator that cannot be used here."""


def find_jemalloc() -> Path | None:
    """Ray's bundled ``libjemalloc.so`` when Ray is installed, else the system's, else None."""
    spec = importlib.util.find_spec("ray")
    for location in (spec.submodule_search_locations or []) if spec else []:
        bundled = Path(location) / "core" / "libjemalloc.so"
        if bundled.is_file():
            return bundled
    name = ctypes.util.find_library("jemalloc")  # a soname such as libjemalloc.so.2: LD_PRELOAD finds it
    return Path(name) if name else None


def how_to_get_jemalloc(installed: Path | None) -> str:
    """What a process on glibc's ``malloc`` should do to run on jemalloc: stop asking for glibc where one
    is installed (``installed``), else install one."""
    if installed is not None:
        return f"unset {ENV} (jemalloc is installed: {installed})"
    return "pip install 'rlfleet[ray]' (Ray's wheel ships it) or apt install libjemalloc2"


def chosen_jemalloc(env: Mapping[str, str], platform: str = sys.platform) -> Path | None:
    """The jemalloc a training process should run on, from ``RLFLEET_ALLOCATOR`` (``auto`` when unset):
    None for glibc's ``malloc`` (asked for, not Linux, or none found under ``auto``)."""
    choice = env.get(ENV, "auto").strip() or "auto"
    if choice == "glibc":
        return None
    if choice not in ("auto", "jemalloc"):
        path = Path(choice)
        if not path.is_file():
            raise AllocatorError(
                f"{ENV}={choice!r}: no such file; set it to auto, glibc, jemalloc or the path of a "
                "libjemalloc.so"
            )
        return path
    found = find_jemalloc() if platform.startswith("linux") else None
    if found is None and choice == "jemalloc":
        raise AllocatorError(
            f"{ENV}=jemalloc, but no jemalloc is installed (Ray's wheel ships one: pip install "
            "'rlfleet[ray]'; or the system's libjemalloc2); fix: install one, or unset "
            f"{ENV} (glibc's malloc is used)"
        )
    return found


def reexec_argv(
    env: Mapping[str, str], orig_argv: Sequence[str], executable: str, platform: str = sys.platform
) -> tuple[list[str], dict[str, str]] | None:
    """The command line and environment that re-run this process on jemalloc, or None when it should
    go on as it is (already on it, glibc chosen, none found)."""
    if ACTIVE_ENV in env:
        return None
    lib = chosen_jemalloc(env, platform)
    if lib is None:
        return None
    preload = " ".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    new_env = {**env, "LD_PRELOAD": preload, "MALLOC_CONF": JEMALLOC_CONF, ACTIVE_ENV: str(lib)}
    return [executable, *orig_argv[1:]], new_env


def run_on_jemalloc() -> None:
    """Re-executes this process on jemalloc when ``reexec_argv`` says so (never returns then); in the
    re-executed process, removes the variables so that child processes start on their own allocator."""
    plan = reexec_argv(os.environ, sys.orig_argv, sys.executable)
    if plan is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        argv, env = plan
        os.execve(argv[0], argv, env)
    if ACTIVE_ENV in os.environ:
        lib = os.environ[ACTIVE_ENV]
        preload = [p for p in os.environ.get("LD_PRELOAD", "").split() if p != lib]
        if preload:
            os.environ["LD_PRELOAD"] = " ".join(preload)
        else:
            os.environ.pop("LD_PRELOAD", None)
        if os.environ.get("MALLOC_CONF") == JEMALLOC_CONF:
            os.environ.pop("MALLOC_CONF")


@functools.cache
def _mallctl() -> Callable[..., int] | None:
    """jemalloc's ``mallctl`` when this process's ``malloc`` is jemalloc, else None."""
    try:
        fn = ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def running_allocator() -> str:
    """``jemalloc`` or ``glibc``: the ``malloc`` this process runs on (``other`` off glibc)."""
    if _mallctl() is not None:
        return "jemalloc"
    return "glibc" if sys.platform.startswith("linux") else "other"


def jemalloc_purge() -> bool:
    """Returns jemalloc's freed pages, in every arena, to the OS; False when not on jemalloc."""
    fn = _mallctl()
    if fn is None:
        return False
    return int(fn(f"arena.{MALLCTL_ARENAS_ALL}.purge".encode(), None, None, None, 0)) == 0
