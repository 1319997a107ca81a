"""``release_free_memory`` hands the heap a step freed back to the OS (glibc; see rlfleet.memory.probes).

The pattern of a training pass on a CPU: blocks under glibc's adaptive mmap threshold come from its heap,
and smaller blocks still alive between them (here pins) keep glibc from trimming the freed ones on its own.
Freed, they stay resident until ``malloc_trim``. Measured in a fresh interpreter: a process that has run
other tests has an allocator state of its own (thresholds, free lists) that the premise cannot rely on.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, torch
from rlfleet.memory.probes import release_free_memory
MB = 1 << 20
def resident_mb():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) / 1024 for l in status if l.startswith("VmRSS:"))
raise_threshold = torch.ones(16 * MB // 4)  # an mmapped block, freed: glibc's threshold rises to it
del raise_threshold
blocks, pins = [], []
for _ in range(128):  # 256 MB from the heap, touched, each followed by a small block that stays
    blocks.append(torch.ones(2 * MB // 4))
    pins.append(torch.ones(16 * 1024 // 4))
held = resident_mb()
del blocks
freed = resident_mb()
ok = release_free_memory() if {release} else None
print(json.dumps({{"held": held, "freed": freed, "released": resident_mb(), "ok": ok, "pins": len(pins)}}))
"""


def probe(release: bool) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(release=release)], capture_output=True, text=True, check=True
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_freed_heap_blocks_go_back_to_the_os() -> None:
    kept = probe(release=False)
    assert kept["freed"] > kept["held"] - 64 and kept["released"] > kept["held"] - 64  # glibc kept them
    given = probe(release=True)
    assert given["ok"] is True and given["pins"] == 128
    assert given["freed"] > given["held"] - 64
    assert given["released"] < given["freed"] - 192  # and gave them back when asked
