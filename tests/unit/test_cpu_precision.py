"""bfloat16/float16 on a CPU: native or emulated, read from the CPU's flags."""

from __future__ import annotations

from rlfleet.utils.cpu import cpu_flags, slow_cpu_precision

SAPPHIRE = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd fphp asimdhp bf16 sve\n"


def test_flags_are_read_from_cpuinfo() -> None:
    assert {"avx512_bf16", "amx_bf16"} <= (cpu_flags(SAPPHIRE) or set())
    assert "bf16" in (cpu_flags(GRAVITON3) or set())
    assert cpu_flags("processor: 0\n") is None  # nothing known: nothing claimed


def test_emulated_precisions_are_named_with_the_fix() -> None:
    assert slow_cpu_precision("bfloat16", cpu_flags(SAPPHIRE)) is None
    assert slow_cpu_precision("bfloat16", cpu_flags(GRAVITON3)) is None
    assert slow_cpu_precision("float16", cpu_flags(GRAVITON3)) is None
    why = slow_cpu_precision("bfloat16", cpu_flags(SKYLAKE))
    assert why is not None and "avx512_bf16 / amx_bf16" in why and "fix: policy.precision=float32" in why
    assert slow_cpu_precision("float16", cpu_flags(SAPPHIRE)) is not None
    assert slow_cpu_precision("float32", cpu_flags(SKYLAKE)) is None
    assert slow_cpu_precision("bfloat16", None) is None


def test_this_machine_is_classified() -> None:
    flags = cpu_flags()
    if flags is not None:  # Linux: the answer follows the flags
        assert (slow_cpu_precision("bfloat16", flags) is None) == bool(
            flags & {"avx512_bf16", "amx_bf16", "bf16"}
        )
