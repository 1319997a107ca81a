"""How the vLLM CPU engine should share this machine with the trainer: start-up, generation and refit
(issue 19), side by side in one run.

On a CPU, synchronous GRPO alternates: the engine generates while the trainer waits, then the trainer
trains while the engine waits. vLLM's CPU build by default binds its worker to all cores but one and keeps
that one for its scheduler process (on 2 cores: the worker computes on 1), and compiles the model at
start-up (``enforce_eager=false``). Each row starts an engine the way rlfleet does
(``VLLMGenerationBackend``: the trainer's bf16 weights written for it, then ``LLM(...)``) and times:

- start-up: the engine's construction (compilation and warm-up included);
- generation: ``--prompts`` prompts x ``--max-new-tokens`` tokens, EOS ignored, temperature 1, one seed
  per row (the training request; see ``generation_backends.generate_ignoring_eos``), after a small warm-up;
- refit: ``VLLMGenerationBackend.refit()`` (the per-step weight reload), best of 3;
- the trainer's view: a training-sized float32 matmul timed in this process while the engine is idle, as
  a check that an idle engine does not steal the trainer's cores.

Rows vary ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (1, vLLM's default for one worker on x86, or 0: the worker
computes on every core) and ``enforce_eager`` (compiled or eager). Every row starts cold: its own empty
``VLLM_CACHE_ROOT``, so no row reuses another's compiled graph (a later run of the same model finds its
compilation cached and starts faster). rlfleet's default is the row marked ``*``.

    python benchmarks/vllm_cpu_setup.py            # SmolLM2-135M-Instruct, 64 prompts x 128 tokens
    python benchmarks/vllm_cpu_setup.py --quick    # tiny model, 8 prompts x 16 tokens: a smoke check
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.generation_backends import (
    SEED,
    generate_ignoring_eos,
    load_smollm2,
    load_tiny,
    matmul_peak_flops,
)

from rlfleet.generation.vllm import (
    CPU_RESERVED_DEFAULT,
    RESERVED_CPU_ENV,
    VLLMGenerationBackend,
    VLLMSettings,
)


@dataclass(frozen=True)
class Variant:
    name: str
    reserved_cpus: str  # VLLM_CPU_NUM_OF_RESERVED_CPU
    eager: bool


@dataclass(frozen=True)
class Result:
    variant: Variant
    startup_s: float
    generation_s: float
    tokens: int
    refit_s: float
    matmul_gflops: float


VARIANTS = (
    Variant("vLLM default (1 core reserved), compiled", "1", False),
    Variant("vLLM default (1 core reserved), eager", "1", True),
    Variant("every core, compiled", "0", False),
    Variant("every core, eager", "0", True),
)


def run_variant(  # type: ignore[no-untyped-def]
    variant: Variant, model, tokenizer, prompts: list[list[int]], new_tokens: int, cache_root: Path
) -> Result:
    settings = VLLMSettings(
        precision="bfloat16",
        max_model_len=max(map(len, prompts)) + new_tokens,
        seed=SEED,
        enforce_eager=variant.eager,
    )
    saved = {key: os.environ.get(key) for key in (RESERVED_CPU_ENV, "VLLM_CACHE_ROOT")}
    os.environ[RESERVED_CPU_ENV] = variant.reserved_cpus  # inherited by the engine's processes
    os.environ["VLLM_CACHE_ROOT"] = str(cache_root)
    start = time.perf_counter()
    backend = VLLMGenerationBackend(model, tokenizer, settings)
    startup = time.perf_counter() - start
    try:
        generate_ignoring_eos(backend, tokenizer, prompts[:2], 4)  # warm-up
        start = time.perf_counter()
        tokens = generate_ignoring_eos(backend, tokenizer, prompts, new_tokens)
        generation = time.perf_counter() - start
        refits = []
        for _ in range(3):
            start = time.perf_counter()
            backend.refit()
            refits.append(time.perf_counter() - start)
        gflops = matmul_peak_flops(repeats=5) / 1e9  # the trainer's cores, engine idle
        return Result(variant, startup, generation, tokens, min(refits), gflops)
    finally:
        backend.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="tiny model, 8 prompts x 16 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens = 8, 16
    alone = matmul_peak_flops(repeats=5) / 1e9
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer, prompts = load_tiny(args, Path(tmp)) if args.quick else load_smollm2(args)
        model.eval()
        print(
            f"model: {'tiny (quick)' if args.quick else 'SmolLM2-135M-Instruct'}; {len(prompts)} prompts x "
            f"{args.max_new_tokens} tokens (EOS ignored); {os.cpu_count()} CPUs; torch threads "
            f"{torch.get_num_threads()}; float32 matmul with no engine: {alone:.1f} GFLOP/s",
            flush=True,
        )
        results = []
        for i, variant in enumerate(VARIANTS):
            result = run_variant(
                variant, model, tokenizer, prompts, args.max_new_tokens, Path(tmp) / f"cache{i}"
            )
            results.append(result)
            print(
                f"  {variant.name}: start {result.startup_s:.1f} s, generation {result.generation_s:.1f} s, "
                f"refit {result.refit_s:.2f} s",
                flush=True,
            )
    base = results[0]
    print()
    print(
        "| engine set-up | start s | generation s | tokens/s | vs vLLM default | refit s | matmul GFLOP/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        mark = " *" if (r.variant.reserved_cpus, r.variant.eager) == DEFAULT else ""
        print(
            f"| {r.variant.name}{mark} | {r.startup_s:.1f} | {r.generation_s:.1f} | "
            f"{r.tokens / r.generation_s:.0f} | {base.generation_s / r.generation_s:.2f}x | "
            f"{r.refit_s:.2f} | {r.matmul_gflops:.1f} |"
        )
    print(f"\nno engine: trainer matmul {alone:.1f} GFLOP/s; * = rlfleet's default on a CPU")


DEFAULT = (CPU_RESERVED_DEFAULT, False)  # rlfleet's engine on a CPU: reservation, enforce_eager

if __name__ == "__main__":  # vLLM starts its engine processes with spawn
    main()
