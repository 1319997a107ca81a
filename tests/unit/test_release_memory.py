"""``release_free_memory`` hands the heap a step freed back to the OS (glibc; see rlfleet.memory.probes).

The pattern of a training pass on a CPU: blocks under glibc's adaptive mmap threshold come from its heap,
and smaller blocks still alive between them (here pins) keep glibc from trimming the freed ones on its own.
Freed, they stay resident until ``malloc_trim``. Measured in a fresh interpreter: a process that has run
other tests has an allocator state of its own (thresholds, free lists) that the premise cannot rely on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_the_heap_is_released_only_past_the_slack(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlfleet.memory import probes

    resident = iter([500, 480, 560, 700, 600, 650, 900, 610])  # MiB as read: before / after each release
    released: list[int] = []
    monkeypatch.setattr(probes, "resident_bytes", lambda: next(resident) * 2**20)
    monkeypatch.setattr(probes, "release_free_memory", lambda: released.append(1) or True)
    heap = probes.HeapReleaser(slack_bytes=128 * 2**20)
    outcomes = [heap.after_pass() for _ in range(5)]
    # first pass: releases (no floor yet; 480 after); 560 and 600 stay within 128 of it; 700 and 900 do not
    assert outcomes == [True, False, True, False, True]
    assert heap.releases == len(released) == 3 and heap.floor == 610 * 2**20


def test_the_slack_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlfleet.memory import probes

    monkeypatch.setenv(probes.HEAP_SLACK_ENV, "0")
    assert probes.HeapReleaser().slack == 0
    monkeypatch.delenv(probes.HEAP_SLACK_ENV)
    assert probes.heap_slack_bytes() == probes.DEFAULT_HEAP_SLACK_MIB * 2**20
    monkeypatch.setenv(probes.HEAP_SLACK_ENV, "lots")
    with pytest.raises(ValueError, match="whole number of MiB"):
        probes.heap_slack_bytes()


HOLDER = """
import sys
block = bytearray(64 * 2**20)  # touched: resident
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.read()
"""
GRANDCHILD = f"""
import subprocess, sys
block = bytearray(96 * 2**20)  # touched: resident
pipe = subprocess.PIPE
child = subprocess.Popen([sys.executable, "-c", {HOLDER!r}], stdin=pipe, stdout=pipe, text=True)
assert child.stdout.readline() == "ready\\n"
del block  # freed: the peak stays
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.read()
child.stdin.close(); child.wait()
"""


@pytest.mark.skipif(
    not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(),
    reason="the kernel lists no children in /proc (Linux with CONFIG_PROC_CHILDREN)",
)
def test_the_processes_a_run_started_are_measured_to_the_last_grandchild() -> None:
    """``memory/children_*``: a child that held 96 MiB and freed it, and its own child holding 64 MiB."""
    from rlfleet.memory.probes import descendant_pids, descendants_resident_bytes

    before = descendants_resident_bytes()
    child = subprocess.Popen(
        [sys.executable, "-c", GRANDCHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        pids = descendant_pids()
        assert child.pid in pids and len(pids) >= 2  # the grandchild too
        measured = descendants_resident_bytes()
        assert measured is not None
        now, peak = measured
        base = 0 if before is None else before[0]
        assert now - base >= 64 * 2**20  # the grandchild's block, resident
        assert peak >= now + 90 * 2**20  # the child's freed block stays in its peak
        again = descendants_resident_bytes()  # peaks reset by the previous call
        assert again is not None and again[1] < peak - 64 * 2**20
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=60)
