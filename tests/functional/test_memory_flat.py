"""Resident memory stays flat from step to step (issue 20): nothing the loop keeps grows with the run.

A float32 run of the tiny model through the CLI, in its own process (a long pytest process has its own
allocator history), logs ``memory/trainer_rss_gib`` after every step. bfloat16 is not used here: on a CPU
oneDNN's primitive cache, ideep's LRU cache and the flash-attention kernel cache keep a compiled kernel for
every new matmul/attention shape until they are full (measured on this model: resident memory rose about
60 MB a step for 12 steps and then stayed flat; with the caches off it is flat from the first step), which
is the libraries' bounded cache, not rlfleet's growth.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.logging import read_metrics
from rlfleet.memory.allocator import ENV, find_jemalloc
from rlfleet.memory.probes import HEAP_SLACK_ENV
from tests.conftest import small_grpo_overrides

pytestmark = pytest.mark.slow

STEPS = 30
WARM_UP = 5  # steps before memory is compared: the first passes allocate the optimizer state and caches


@pytest.mark.parametrize(
    "allocator", ["jemalloc", "glibc"]
)  # rlfleet's default where installed; the fallback
def test_resident_memory_is_flat_after_warm_up(tiny_model_dir: Path, tmp_path: Path, allocator: str) -> None:
    if allocator == "jemalloc" and find_jemalloc() is None:
        pytest.skip("no jemalloc installed here")
    overrides = [
        *small_grpo_overrides(tiny_model_dir, tmp_path),
        f"grpo.max_num_steps={STEPS}",
        f"data.arithmetic.num_train={4 * STEPS}",
        "grpo.val_period=1000",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "checkpointing.enabled=false",
        "policy.precision=float32",
        "policy.sequence_packing.enabled=true",  # a packed micro-batch of a new size every step
    ]
    cmd = [sys.executable, "-m", "rlfleet.cli", "grpo", "grpo-tiny-arithmetic-cpu", *overrides]
    env = {**os.environ, ENV: allocator, HEAP_SLACK_ENV: "0"}  # trim after every pass: growth shows at once
    subprocess.run(cmd, check=True, capture_output=True, timeout=900, env=env)
    rss = [
        r["memory/trainer_rss_gib"] * 1024
        for r in read_metrics(tmp_path / "logs")
        if "memory/trainer_rss_gib" in r
    ]
    assert len(rss) == STEPS
    settled = rss[WARM_UP - 1]
    growth = max(rss[WARM_UP:]) - settled
    assert growth < 16, (
        f"resident memory grew {growth:.0f} MiB after step {WARM_UP}: {[round(x) for x in rss]}"
    )
