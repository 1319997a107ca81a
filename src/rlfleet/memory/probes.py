"""Handing memory a step freed back to the operating system.

On Linux, PyTorch's CPU tensors come from glibc's ``malloc``. Blocks under glibc's (adaptive, up to 32 MB)
mmap threshold, which is every activation of a micro-batch of a small model, live in its heap, and glibc
keeps what they free for later allocations. With packed micro-batches of a different size every step, the
freed space fragments and the process's resident memory climbs step after step although its live tensors
do not (measured on SmolLM2, issue 20: live tensors 1.61 GB at every step, resident memory 3.75 GB after
step 1 and 6.27 GB after step 12; ``malloc_trim(0)`` returned 3 GB of it). Trimming after each training
pass keeps the process at its live memory between steps, while the generation engine runs. Forcing large
blocks to mmap instead (``M_MMAP_THRESHOLD``) trained 1.47x slower on this machine (12 SmolLM2 steps):
each block is faulted in afresh. The ``rlfleet`` commands that train run on jemalloc where one is installed
(``rlfleet.utils.allocator``): less fragmentation within a pass, and a purge at its end instead of the
trim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rlfleet.utils.allocator import jemalloc_purge


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
    the process runs on it (``rlfleet.utils.allocator``), glibc's free heap otherwise. False where there is
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


class LiveTensorBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the bytes of CPU tensor storages created under it that are still alive; ``peak`` is the
    most at once. Storages an op was given (in-place results, views) are not new and are not counted.

    A measuring tool for tests and benchmarks (every op goes through Python: slow on large models).
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in self._seen and key not in given:
                size = storage.nbytes()
                self._seen.add(key)
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, size)
        return out
