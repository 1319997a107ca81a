"""Whether this CPU computes in 16-bit floats natively, so that ``policy.precision`` is a choice, not a guess.

On an x86 CPU with AVX-512-BF16 or AMX-BF16 (Cooper Lake, Sapphire Rapids and later; Zen 4 and later),
torch's bfloat16 matmuls run markedly faster than float32 ones; without them bfloat16 is emulated and
runs far slower than float32. float16 is native only with AMX-FP16 (x86) or the ``fphp``/``asimdhp``
features (Arm). The flags come from ``/proc/cpuinfo`` (Linux); elsewhere nothing is known and nothing is
claimed.
"""

from __future__ import annotations

from pathlib import Path

NATIVE_FLAGS = {
    "bfloat16": ("avx512_bf16", "amx_bf16", "bf16"),  # bf16: Arm's BFloat16 feature
    "float16": ("amx_fp16", "avx512_fp16", "fphp", "asimdhp"),
}


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU's feature flags (x86 ``flags`` / Arm ``Features`` lines), or None where unknown."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        if not path.is_file():
            return None
        cpuinfo = path.read_text(errors="replace")
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags or None


def slow_cpu_precision(precision: str, flags: set[str] | None) -> str | None:
    """Why ``precision`` is slow on a CPU with these flags (None: native, float32, or unknown)."""
    native = NATIVE_FLAGS.get(precision)
    if native is None or flags is None or flags & set(native):
        return None
    return (
        f"policy.precision={precision} on a CPU without {' / '.join(native[:2])} instructions: {precision} "
        "matmuls are emulated there and run much slower than float32; fix: policy.precision=float32 "
        "(the master weights are float32 either way)"
    )
