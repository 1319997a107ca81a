"""Smoke test of benchmarks/packing.py: the three layouts run on the tiny model and the table prints; its
arguments."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.policy.microbatch import PACKED_WIDTHS_PER_DOUBLING
from tests.conftest import markdown_rows, run_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "packing.py"


def test_quick_caps_the_rows_and_runs_once() -> None:
    from benchmarks.packing import parse_args

    full = parse_args([])
    assert (full.rows, full.repeats, full.distributions) == (64, 3, ["arithmetic", "gsm8k"])
    assert (parse_args(["--quick"]).rows, parse_args(["--quick"]).repeats) == (16, 1)
    assert parse_args(["--quick", "--rows", "8"]).rows == 8  # fewer rows where asked


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_prints_padding_and_times_per_layout() -> None:
    out = run_benchmark(SCRIPT, "--quick", "--distributions", "arithmetic", "--rows", "8")
    rows = markdown_rows(out, "layout")
    assert set(rows) == {"padded", "dynamic", "packed"}
    padding = {name: float(cells[3].strip().rstrip("%")) / 100 for name, cells in rows.items()}
    # a packed row is rounded up to a width on the grid: at most 1/16 of its slots are padding
    assert padding["packed"] <= 1 / PACKED_WIDTHS_PER_DOUBLING
    assert padding["padded"] > padding["packed"]
