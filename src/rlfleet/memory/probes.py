"""This process's resident memory, and handing memory a step freed back to the operating system.

On Linux, PyTorch's CPU tensors come from glibc's ``malloc``. Blocks under glibc's adaptive mmap threshold,
which is every activation of a micro-batch of a small model, live in its heap, and glibc keeps what they
free for later allocations. With packed micro-batches of a different size every step, the freed space
fragments and the process's resident memory climbs step after step although its live tensors do not
(``benchmarks/memory.py --steps`` measures it). Trimming after a training pass (``malloc_trim(0)``) brings the
process back to its live memory between steps, while the generation engine runs. Trimming costs: a full
garbage collection, and the next pass faults the returned pages in again, which on a small model is more
than the pass itself; so :class:`HeapReleaser` trims only once the process has grown by more than a slack
(``RLFLEET_HEAP_SLACK_MIB``, default 128) since its last trim: resident memory stays within that slack of
the live memory, and a small model's passes never pay for it.
Forcing large blocks to mmap instead (``M_MMAP_THRESHOLD``) trains slower: each block is faulted in afresh.
The ``rlfleet`` commands that train run on jemalloc where one is installed (``rlfleet.memory.allocator``):
less fragmentation within a pass, and a purge at its end instead of the trim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os

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


def _status_bytes(pid: int | str, *fields: str) -> dict[str, int]:
    """``fields`` of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``...) in bytes; those it lacks, or all when
    the process cannot be read (ended, or off Linux), are left out."""
    found: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in fields:
                    found[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return {}
    return found


def _status_kib(field: str) -> int | None:
    value = _status_bytes("self", field).get(field)
    return None if value is None else value // 1024


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


def descendant_pids(pid: int | None = None) -> list[int]:
    """Every process started under ``pid`` (this one by default), children of any of its threads, their
    children and so on (Linux ``/proc/<pid>/task/<tid>/children``); empty elsewhere."""
    found: list[int] = []
    todo = [os.getpid() if pid is None else pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def descendants_resident_bytes() -> tuple[int, int] | None:
    """``(resident now, peak)`` summed over the processes this one started (a vLLM engine's, environment
    workers, a local Ray cluster's), each process's peak (``VmHWM``) since the previous call, which resets
    it; None when there are none, or off Linux. The sum of peaks bounds their peak together from above."""
    now = peak = 0
    pids = descendant_pids()
    for pid in pids:
        fields = _status_bytes(pid, "VmRSS", "VmHWM")
        if not fields:
            continue  # ended meanwhile, or not ours to read
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        now += fields.get("VmRSS", 0)
        peak += fields.get("VmHWM", 0)
    return (now, peak) if pids else None


def step_memory_metrics() -> dict[str, float]:
    """What every step of a run logs (Linux; none elsewhere): ``memory/trainer_rss_gib`` (this process's
    resident memory now) and ``memory/trainer_peak_rss_gib`` (its peak since the previous step's), and
    ``memory/children_rss_gib`` / ``memory/children_peak_rss_gib``, the same summed over the processes it
    started (a CPU vLLM engine's, environment workers, a local Ray cluster's: what ``rlfleet plan`` counts
    beside the ranks). Resident memory counts the shared libraries' pages too (about 0.2 GiB a process)."""
    now, peak = resident_bytes(), take_peak_resident_bytes()
    if now is None or peak is None:
        return {}
    out = {"memory/trainer_rss_gib": now / 2**30, "memory/trainer_peak_rss_gib": peak / 2**30}
    children = descendants_resident_bytes()
    if children is not None:
        out["memory/children_rss_gib"] = children[0] / 2**30
        out["memory/children_peak_rss_gib"] = children[1] / 2**30
    return out


HEAP_SLACK_ENV = "RLFLEET_HEAP_SLACK_MIB"
DEFAULT_HEAP_SLACK_MIB = 128


def heap_slack_bytes() -> int:
    """``RLFLEET_HEAP_SLACK_MIB`` (default 128) in bytes; 0 trims after every pass.

    Raises:
        ValueError: The variable is not a non-negative integer.
    """
    text = os.environ.get(HEAP_SLACK_ENV, str(DEFAULT_HEAP_SLACK_MIB))
    if not text.strip().isdigit():
        raise ValueError(f"{HEAP_SLACK_ENV}={text!r}: give a whole number of MiB (0 trims after every pass)")
    return int(text) * 2**20


class HeapReleaser:
    """Returns the heap freed by training passes to the OS, once the process has grown past a slack.

    Args:
        slack_bytes: Growth of resident memory since the last release that triggers the next one (None:
            :func:`heap_slack_bytes`).
    """

    def __init__(self, slack_bytes: int | None = None) -> None:
        self.slack = heap_slack_bytes() if slack_bytes is None else slack_bytes
        self.floor: int | None = None  # resident memory right after the last release
        self.releases = 0

    def after_pass(self) -> bool:
        """Releases when resident memory is more than the slack above the last release's (always the first
        time, and wherever resident memory cannot be read); returns whether it released."""
        now = resident_bytes()
        if now is not None and self.floor is not None and now - self.floor <= self.slack:
            return False
        release_free_memory()
        self.floor = resident_bytes()
        self.releases += 1
        return True
