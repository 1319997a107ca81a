"""Smoke test of benchmarks/train_pass.py: settings without compiling (``tests/functional/test_compile.py``
checks the compiled path) run on the tiny model, the table and the attention line print; its arguments."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import markdown_rows, run_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_pass.py"


def test_arguments_and_settings() -> None:
    from benchmarks.train_pass import SETTINGS_ROWS, parse_args

    full = parse_args([])
    assert (full.model, full.rows, full.steps, full.settings) == ("smollm2", 16, 3, None)
    quick = parse_args(["--quick"])
    assert (quick.model, quick.rows, quick.steps, quick.settings) == ("tiny", 4, 1, [0, 1, 2])
    before, *after = SETTINGS_ROWS
    assert not (before.fused or before.compile or before.window_packing) and before.checkpointing
    assert after[-1].compile and after[-1].fused and not after[-1].checkpointing


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_prints_each_setting_against_the_floor() -> None:
    out = run_benchmark(SCRIPT, "--quick", "--settings", "0", "2")
    rows = markdown_rows(out, "setting")
    assert set(rows) == {"before", "+ fused AdamW"}
    for cells in rows.values():
        assert cells[2].strip() == "sdpa_packed"  # packing switched the tiny Llama to per-sequence attention
        assert float(cells[3]) > 0 and float(cells[4].strip().rstrip("x")) > 1  # slower than the floor
        assert float(cells[7]) == 0.0  # nothing compiled
    assert "attention alone, forward and backward over the packed row (x 4 layers)" in out
