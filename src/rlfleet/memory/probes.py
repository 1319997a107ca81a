"""This process's resident memory, and handing memory a step freed back to the operating system.

On Linux, PyTorch's CPU tensors come from glibc's ``malloc``. Blocks under glibc's adaptive mmap threshold,
which is every activation of a micro-batch of a small model, live in its heap, and glibc keeps what they
free for later allocations. With packed micro-batches of a different size every step, the freed space
fragments and the process's resident memory climbs step after step although its live tensors do not
(issue 20; ``benchmarks/memory.py --steps`` measures it). Trimming after each training pass
(``malloc_trim(0)``) keeps the process at its live memory between steps, while the generation engine runs.
Forcing large blocks to mmap instead (``M_MMAP_THRESHOLD``) trains slower: each block is faulted in afresh.
The ``rlfleet`` commands that train run on jemalloc where one is installed (``rlfleet.memory.allocator``):
less fragmentation within a pass, and a purge at its end instead of the trim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

from rlfleet.memory.allocator import jemalloc_purge


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 (musl and macOS have no malloc_trim)
    except (OSError, AttributeError):
        return None
    return libc


def release_free_memory() -> bool:
    """Collects garbage, then returns the allocator's free memory to the OS: jemalloc's freed pages when
    the process runs on it (``rlfleet.memory.allocator``), glibc's free heap otherwise. False where there is
    neither (another platform: nothing to do)."""
    gc.collect()
    if jemalloc_purge():
        return True
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux ``VmRSS``), or None elsewhere."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def take_peak_resident_bytes() -> int | None:
    """This process's peak resident memory since the last call (Linux ``VmHWM``, then reset through
    ``/proc/self/clear_refs``), or None elsewhere."""
    kib = _status_kib("VmHWM")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return None if kib is None else kib * 1024
