"""Smoke test of benchmarks/train_pass.py: settings without compiling (``tests/functional/test_compile.py``
checks the compiled path) run on the tiny model, the table and the attention line print; its arguments."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

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


def test_profile_groups_sum_each_operators_own_time_by_kind() -> None:
    from benchmarks.train_pass import profile_groups

    def event(key: str, micros: float, flops: float = 0.0) -> SimpleNamespace:
        return SimpleNamespace(key=key, self_cpu_time_total=micros, flops=flops)

    events = [
        event("aten::mm", 2e6, flops=4e9),
        event("aten::addmm", 1e6, flops=2e9),
        event("aten::linear", 0.1e6),  # a wrapper: its own time is not a matmul's
        event("aten::_scaled_dot_product_flash_attention_for_cpu_backward", 0.5e6),
        event("Torch-Compiled Region: 0/0", 0.7e6),
        event("CompiledFunctionBackward", 0.3e6),
        event("Optimizer.step#AdamW.step", 0.05e6),
        event("aten::_fused_adamw_", 0.2e6),
        event("aten::_foreach_mul_", 0.1e6),
        event("aten::copy_", 0.4e6),
        event("aten::_to_copy", 0.1e6),
        event("aten::mul", 0.6e6),
    ]
    groups = profile_groups(events)
    by_name = {g.name: g for g in groups}
    assert by_name["matmuls"].seconds == pytest.approx(3.0) and by_name["matmuls"].flops == 6e9
    assert by_name["attention (sdpa)"].seconds == pytest.approx(0.5)
    assert by_name["compiled regions' own kernels"].seconds == pytest.approx(1.0)
    assert by_name["optimizer"].seconds == pytest.approx(0.35)
    assert by_name["copies and casts"].seconds == pytest.approx(0.5)
    rest = groups[-1]
    assert rest.operators == {"aten::linear": pytest.approx(0.1), "aten::mul": pytest.approx(0.6)}
    # synthetic profiler events, no clock: the groups partition the events' own time exactly
    grouped, recorded = sum(g.seconds for g in groups), sum(e.self_cpu_time_total for e in events) / 1e6
    assert grouped == pytest.approx(recorded)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_prints_each_setting_against_the_floor() -> None:
    out = run_benchmark(SCRIPT, "--quick", "--settings", "0", "2", "--profile")
    profile = out[out.index("where one training pass goes (+ fused AdamW") :]
    parts = markdown_rows(profile, "part")
    assert list(parts)[:2] == ["matmuls", "attention (sdpa)"] and len(parts) == 6
    assert float(parts["matmuls"][2]) > 0 and float(parts["attention (sdpa)"][2]) > 0
    assert float(parts["optimizer"][2]) > 0  # the fused AdamW kernel
    assert sum(float(cells[3].strip().rstrip("%")) for cells in parts.values()) == pytest.approx(100, abs=3)
    rows = markdown_rows(out[: out.index("where one training pass goes")], "setting")
    assert set(rows) == {"before", "+ fused AdamW"}
    for cells in rows.values():
        assert cells[2].strip() == "sdpa_packed"  # packing switched the tiny Llama to per-sequence attention
        assert float(cells[3]) > 0 and float(cells[4].strip().rstrip("x")) > 1  # slower than the floor
        assert float(cells[7]) == 0.0  # nothing compiled
    assert "attention alone, forward and backward over the packed row (x 4 layers)" in out
