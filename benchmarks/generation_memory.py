"""Generation memory and prompt padding, before and after issue 9.

Memory: peak resident memory of one ``generate`` call on a random 1-layer Llama with a 150k vocabulary
(B prompts x N new tokens), each run in a fresh subprocess (``ru_maxrss`` minus the resident size before the
call). "keep logits" is the path before issue 9: ``output_logits=True``, every step's ``[B, V]`` logits
stacked to ``[B, N, V]`` float32 and scored afterwards; "backend" is ``HFGenerationBackend`` now, whose
sampler scores each drawn token as it goes. An address-space limit stops a run before it takes the machine's
memory; such a run reads "> LIMIT".

Padding: the fraction of the prompt block that is left padding (pad tokens / all prompt-block tokens over
the ``generate`` batches), for prompts batched in the order they come (today's GRPO order: each prompt
repeated G times) and longest first (``length_sorted_batches``). Prompt lengths are synthetic, log-normal
with the median and spread of the GSM8k test prompts rendered with a system prompt (111 tokens, sigma 0.2
in log space), or one integer per line from ``--lengths-file``.

    python benchmarks/generation_memory.py
    python benchmarks/generation_memory.py --tokens 16 32 --skip-padding
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
from collections.abc import Sequence

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessorList

from rlfleet.generation import HFGenerationBackend, SamplingParams
from rlfleet.generation.hf import length_sorted_batches
from rlfleet.generation.sampling import SeededRowSampler, row_seeds

PAD, EOS = 0, 1


class _Tokenizer:
    pad_token_id, eos_token_id = PAD, EOS

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _keep_logits_generate(model: LlamaForCausalLM, prompts: list[list[int]], params: SamplingParams) -> None:
    """The backend's batch before issue 9: all steps' logits kept, stacked and scored at the end."""
    width = max(map(len, prompts))
    input_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=params.max_new_tokens,
        eos_token_id=EOS,
        pad_token_id=PAD,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
    )
    sampler = SeededRowSampler(row_seeds(0, len(prompts)), params, prompt_width=width)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=(input_ids != PAD).long(),
        generation_config=config,
        logits_processor=LogitsProcessorList([sampler]),
    )
    tokens = out.sequences[:, width:]
    stacked = torch.stack(out.logits, dim=1).float() / params.temperature  # [B, N, V]
    picked = stacked.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    _ = picked - torch.logsumexp(stacked, dim=-1)


@torch.no_grad()
def _child(path: str, batch: int, tokens: int, vocab: int, limit_gb: float) -> dict:
    """One measured call in this (fresh) process."""
    import time

    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=tokens + 64,
    )
    model = LlamaForCausalLM(config).eval()
    prompts = [[2 + (7 * row + j) % 1000 for j in range(8 + row % 9)] for row in range(batch)]
    params = SamplingParams(max_new_tokens=tokens)
    before = _resident_mb()
    limit = int(limit_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    start, error = time.perf_counter(), None
    try:
        if path == "backend":
            HFGenerationBackend(model, _Tokenizer(), batch_size=batch).generate(prompts, params, seed=0)
        else:
            _keep_logits_generate(model, prompts, params)
    except RuntimeError as e:  # out of address space
        error = str(e)[:200]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mb": peak - before, "seconds": time.perf_counter() - start, "error": error}


def memory_table(batch: int, token_counts: Sequence[int], vocab: int, limit_gb: float) -> None:
    print(f"\ngenerate peak memory, {batch} prompts, vocab {vocab:,}, 1-layer Llama (fresh process each)")
    header = f"{'new tokens':>10} {'[B,N,V] f32':>12} {'keep logits':>12} {'backend':>10}"
    print(f"{header} {'s keep':>7} {'s now':>7}")
    for n in token_counts:
        runs = {}
        for path in ("keep_logits", "backend"):
            argv = [sys.executable, __file__, "--child", path, str(batch), str(n), str(vocab), str(limit_gb)]
            proc = subprocess.run(argv, capture_output=True, text=True, check=True)
            runs[path] = json.loads(proc.stdout.strip().splitlines()[-1])

        def mb(run: dict) -> str:
            return f"> {limit_gb:g} GB" if run["error"] else f"{run['peak_mb']:.0f} MB"

        def secs(run: dict) -> str:
            return "-" if run["error"] else f"{run['seconds']:.1f}"

        stacked_gb = batch * n * vocab * 4 / 1e9
        keep, now = runs["keep_logits"], runs["backend"]
        print(f"{n:>10} {stacked_gb:>9.2f} GB {mb(keep):>12} {mb(now):>10} {secs(keep):>7} {secs(now):>7}")


def padding_fraction(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Pad tokens / all prompt-block tokens, each batch left-padded to its longest prompt."""
    pads = total = 0
    for rows in batches:
        width = max(lengths[i] for i in rows)
        pads += sum(width - lengths[i] for i in rows)
        total += width * len(rows)
    return pads / total


def padding_table(pool: Sequence[int], trials: int) -> None:
    layouts = [  # (what, distinct prompts, repeats, generate batch size)
        ("GRPO step, Qwen recipe", 32, 16, 128),
        ("GRPO step", 64, 8, 64),
        ("GRPO step", 128, 4, 128),
        ("eval, distinct prompts", 1024, 1, 128),
    ]
    rng = random.Random(0)
    print(f"\nprompt padding fraction, mean over {trials} draws from {len(pool)} prompt lengths")
    print(f"{'layout':<24} {'prompts x G':>12} {'batch':>6} {'in order':>9} {'sorted':>7}")
    for what, prompts, repeats, batch in layouts:
        before = after = 0.0
        for _ in range(trials):
            lengths = [n for n in rng.sample(list(pool), prompts) for _ in range(repeats)]
            in_order = [list(range(s, min(s + batch, len(lengths)))) for s in range(0, len(lengths), batch)]
            before += padding_fraction(lengths, in_order)
            after += padding_fraction(lengths, length_sorted_batches([[0] * n for n in lengths], batch))
        layout = f"{prompts} x {repeats}"
        print(f"{what:<24} {layout:>12} {batch:>6} {before / trials:>9.1%} {after / trials:>7.1%}")


def synthetic_lengths(count: int, median: float = 111.0, sigma: float = 0.2) -> list[int]:
    rng = random.Random(1)
    return [max(8, round(rng.lognormvariate(0.0, sigma) * median)) for _ in range(count)]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        path, batch, tokens, vocab, limit = sys.argv[2:]
        print(json.dumps(_child(path, int(batch), int(tokens), int(vocab), float(limit))))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--vocab", type=int, default=150_000)
    parser.add_argument("--limit-gb", type=float, default=6.0, help="address-space limit of each run")
    parser.add_argument("--lengths-file", help="prompt lengths, one integer per line (default: synthetic)")
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-padding", action="store_true")
    args = parser.parse_args()
    if not args.skip_memory:
        memory_table(args.batch, args.tokens, args.vocab, args.limit_gb)
    if not args.skip_padding:
        if args.lengths_file:
            with open(args.lengths_file) as f:
                pool = [int(line) for line in f if line.strip()]
        else:
            pool = synthetic_lengths(1319)
        padding_table(pool, args.trials)


if __name__ == "__main__":
    main()
