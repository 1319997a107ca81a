"""``release_free_memory`` hands the heap a step freed back to the OS (glibc; see rlfleet.utils.memory).

The pattern of a training pass on a CPU: blocks under glibc's adaptive mmap threshold come from its heap,
and smaller blocks still alive between them (here pins) keep glibc from trimming the freed ones on its own.
Freed, they stay resident until ``malloc_trim``.
"""

from __future__ import annotations

import sys

import pytest
import torch

from rlfleet.utils.memory import release_free_memory

MB = 1 << 20


def resident_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_freed_heap_blocks_go_back_to_the_os() -> None:
    raise_threshold = torch.ones(16 * MB // 4)  # an mmapped block, freed: glibc's threshold rises to it
    del raise_threshold
    blocks, pins = [], []
    for _ in range(128):  # 256 MB from the heap, touched, each followed by a small block that stays
        blocks.append(torch.ones(2 * MB // 4))
        pins.append(torch.ones(16 * 1024 // 4))
    held = resident_mb()
    del blocks
    freed = resident_mb()
    assert release_free_memory()
    released = resident_mb()
    assert len(pins) == 128
    assert freed > held - 64  # glibc kept the freed blocks resident
    assert released < freed - 192  # and gave them back when asked
