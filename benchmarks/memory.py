"""Peak memory of the logprob and training passes: measured against `rlfleet plan`'s estimate.

Each row runs in a fresh child process: SmolLM2-135M-Instruct (bf16 compute, float32 master weights and
AdamW state, as the SmolLM2 recipes run on a CPU with native bf16), one small warm-up training pass (so the
AdamW moments exist, as in a run), then the measured pass twice on one packed micro-batch of ``tokens``
tokens (rows of 96 prompt + 160 response tokens). "measured" is the child's peak resident memory (Linux
``VmHWM``, reset after the warm-up) over both; "estimated" is the sum of the parts ``rlfleet plan`` prints
for the same layout (``rlfleet.memory.planner.memory_plan`` on the recipe with these overrides). Rows whose
estimate exceeds 75% of the available memory are not run (the run would refuse them, or risk the OOM
killer). On a GPU, ``torch.cuda.max_memory_allocated`` replaces resident memory and no process or heap
term is estimated.

``--growth N`` runs N training passes on packed rows of varied sizes (as GRPO's steps are) in one process
per ``--widths`` setting and prints resident memory after each: exact packed widths against widths on
``rlfleet.policy.microbatch.packed_width``'s grid.

``--steps N`` instead trains the SmolLM2 arithmetic recipe for N steps and prints the trainer's resident
memory after each step (``memory/trainer_rss_gib`` and ``memory/trainer_peak_rss_gib`` of its metrics).

    python benchmarks/memory.py                          # the grid (about 20 minutes on 2 cores)
    python benchmarks/memory.py --tokens 1024 4096 --modes plain ckpt+chunk
    python benchmarks/memory.py --recipe sft-gemma3-270m-gsm8k-cpu --precision float32 --tokens 4096
    python benchmarks/memory.py --recipe sft-gemma3-270m-gsm8k-cpu --tokens 2048 4096 --modes ckpt+chunk \
        --passes train --compile        # Gemma 3 on the fast path: bf16, compiled passes
    python benchmarks/memory.py --steps 20               # resident memory per step of a real run
    python benchmarks/memory.py --growth 25              # per training pass, exact against gridded widths
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: benchmarks/ importable

from benchmarks.scratch import scratch_dir

RECIPE = "grpo-smollm2-135m-gsm8k-cpu"
MODES = {"plain": (False, None), "ckpt": (True, None), "chunk": (False, 512), "ckpt+chunk": (True, 512)}
ROW = (96, 160)  # prompt, response tokens of each packed sequence


def overrides(mode: str, pass_: str, tokens: int, precision: str) -> list[str]:
    ckpt, chunk = MODES[mode]
    key = "train_mb_tokens" if pass_ == "train" else "logprob_mb_tokens"
    return [
        f"policy.precision={precision}",
        "policy.sequence_packing.enabled=true",
        f"policy.sequence_packing.{key}={tokens}",
        f"policy.dtensor_cfg.activation_checkpointing={str(ckpt).lower()}",
        f"policy.logprob_chunk_size={chunk if chunk else 'null'}",
        "loss_fn.reference_policy_kl_penalty=0",
        "policy.generation.backend=hf",  # the estimate of the trainer alone: no engine process here
    ]


def estimate(
    mode: str, pass_: str, tokens: int, precision: str, allocator: str, recipe: str = RECIPE
) -> dict[str, float]:
    from rlfleet.config import load_recipe, resolve_recipe_path
    from rlfleet.config.layout import resource_layout
    from rlfleet.memory.planner import count_parameters, memory_plan

    cfg = load_recipe(resolve_recipe_path(recipe), overrides(mode, pass_, tokens, precision))
    assert cfg.policy.architecture is not None
    n = count_parameters(cfg.policy.architecture)
    plan = memory_plan(cfg, resource_layout(cfg), n, n, allocator=allocator)
    return plan.passes[pass_] | {"_available": float(plan.available or 0)}


def _worker(mode: str, precision: str, recipe: str = RECIPE, compile: bool = False):
    """The recipe's model (SmolLM2 by default) in a policy worker and the GRPO loss, as the SmolLM2 recipes
    train it (KL 0); ``compile``: ``policy.torch_compile`` (the compiled layers and logprobs)."""
    from rlfleet.config import load_recipe, resolve_recipe_path
    from rlfleet.models.loading import ModelSource
    from rlfleet.policy.loss_functions import ClippedPGLossFn
    from rlfleet.policy.rank import OptimizerSettings, PolicyRank

    cfg = load_recipe(resolve_recipe_path(recipe), overrides(mode, "train", 256, "bfloat16"))
    settings = OptimizerSettings(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, max_grad_norm=1.0)
    source = ModelSource(cfg.policy.model_name, precision, cfg.policy.gguf_file)
    worker = PolicyRank(
        source,
        settings,
        keep_reference=False,
        activation_checkpointing=MODES[mode][0],
        torch_compile=compile,
    )
    loss = ClippedPGLossFn(
        eps_low=0.2, eps_high=0.2, dual_clip_c=None, kl_penalty=0.0, kl_input_clamp=20.0,
        kl_output_clamp=10.0, token_level=True, importance_sampling_correction=False,
        prev_from_training_forward=True,
    )  # fmt: skip
    return worker, loss


def _random_batch(worker, gen, responses: list[int]):
    """Rows of ``ROW[0]`` random prompt tokens and the given numbers of random response tokens."""
    import torch

    from rlfleet.policy.batch import collate

    vocab = worker.tokenizer.vocab_size
    prompts = [torch.randint(3, vocab - 1, (ROW[0],), generator=gen).tolist() for _ in responses]
    answers = [torch.randint(3, vocab - 1, (n,), generator=gen).tolist() for n in responses]
    batch = collate(prompts, answers, worker.tokenizer.pad_token_id or 0)
    return batch.with_(advantages=torch.randn(len(responses), generator=gen))


def child(spec: dict) -> dict:
    """One measured row, in this (fresh) process."""
    import torch

    from rlfleet.memory.allocator import running_allocator
    from rlfleet.memory.probes import release_free_memory, take_peak_resident_bytes
    from rlfleet.policy.microbatch import MicroBatching

    worker, loss = _worker(
        spec["mode"], spec["precision"], spec.get("recipe", RECIPE), spec.get("compile", False)
    )
    chunk = MODES[spec["mode"]][1]
    gen = torch.Generator().manual_seed(0)

    def run(tokens: int, pass_: str) -> None:
        batch = _random_batch(worker, gen, [ROW[1]] * max(tokens // sum(ROW), 1))
        batching = MicroBatching(len(batch), tokens, pack=True, logprob_chunk=chunk)
        if pass_ == "train":
            worker.train(batch, loss, global_batch_size=len(batch), micro_batching=batching)
        else:
            worker.logprobs(batch, batching)

    run(256, "train")  # the AdamW moments now exist, as after a run's first step
    release_free_memory()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    take_peak_resident_bytes()
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        run(spec["tokens"], spec["pass"])
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else take_peak_resident_bytes()
    device = "cuda" if cuda else "cpu"
    return {"peak": peak, "seconds": min(seconds), "device": device, "allocator": running_allocator()}


def growth_child(spec: dict) -> dict:
    """Resident memory after each of ``spec["passes"]`` training passes on GRPO-like packed rows, in this
    (fresh) process: 8 to 40 rows (whole groups of 8, as when flat groups are skipped) of random response
    lengths, one packed micro-batch each, with packed widths on a grid of ``spec["widths"]`` per doubling
    (0: every row at its exact width)."""
    import torch

    from rlfleet.memory.allocator import running_allocator
    from rlfleet.memory.probes import release_free_memory, resident_bytes
    from rlfleet.policy import microbatch
    from rlfleet.policy.microbatch import MicroBatching

    if spec["widths"] == 0:
        microbatch.PACKED_WIDTHS_PER_DOUBLING = 1 << 40  # rounds to a multiple of 1: exact widths
    else:
        microbatch.PACKED_WIDTHS_PER_DOUBLING = spec["widths"]
    worker, loss = _worker("ckpt+chunk", spec["precision"])
    gen = torch.Generator().manual_seed(spec["seed"])
    budget = 40 * sum(ROW)
    rss, tokens, seconds = [], [], []
    for _ in range(spec["passes"]):
        rows = 8 * int(torch.randint(1, 6, (1,), generator=gen))
        lengths = torch.randint(16, ROW[1] + 1, (rows,), generator=gen).tolist()
        batch = _random_batch(worker, gen, lengths)
        batching = MicroBatching(rows, budget, pack=True, logprob_chunk=MODES["ckpt+chunk"][1])
        start = time.perf_counter()
        worker.train(batch, loss, global_batch_size=rows, micro_batching=batching)
        seconds.append(time.perf_counter() - start)
        release_free_memory()
        rss.append(resident_bytes() or 0)
        tokens.append(rows * ROW[0] + sum(lengths))
    return {"rss": rss, "tokens": tokens, "seconds": seconds, "allocator": running_allocator()}


def child_env(allocator: str) -> dict[str, str]:
    """The environment of a measured child: on jemalloc as ``rlfleet`` runs one, or on glibc's malloc."""
    from rlfleet.memory.allocator import ENV, reexec_argv

    env = {**os.environ, ENV: allocator}
    plan = reexec_argv(env, [sys.executable], sys.executable)
    return plan[1] if plan else env


def measure(spec: dict, allocator: str) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=child_env(allocator),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(lines[-1])


def grid(args: argparse.Namespace) -> None:
    gib = 2**30
    compiled = ", compiled passes" if args.compile else ""
    print(f"{args.recipe}'s model, {args.precision} compute{compiled}, packed rows of {sum(ROW)} tokens,")
    print(f"{args.allocator} malloc; peak resident memory in a fresh process against rlfleet plan's estimate")
    print("| pass | tokens | mode | estimated GiB | measured GiB | estimate / measured | s per 1k tokens |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for pass_ in args.passes:
        for tokens in args.tokens if pass_ == "train" else args.logprob_tokens:
            for mode in args.modes:
                parts = estimate(mode, pass_, tokens, args.precision, args.allocator, args.recipe)
                available = parts.pop("_available")
                est = sum(parts.values())
                row = f"| {pass_} | {tokens:,} | {mode} | {est / gib:.2f} |"
                if available and est > 0.75 * available:
                    print(f"{row} not run (over 75% of {available / gib:.1f} GiB available) | | |")
                    continue
                spec = {"mode": mode, "pass": pass_, "tokens": tokens, "precision": args.precision}
                spec["recipe"], spec["compile"] = args.recipe, args.compile
                got = measure(spec, args.allocator)
                if "error" not in got and got["allocator"] != args.allocator:
                    got = {"error": f"the child ran on {got['allocator']}, not {args.allocator}"}
                if "error" in got:
                    print(f"{row} failed: {got['error']} | | |")
                    continue
                ratio = est / got["peak"]
                worst = max(worst, abs(ratio - 1))
                print(
                    f"{row} {got['peak'] / gib:.2f} | {ratio:.2f} | {1000 * got['seconds'] / tokens:.2f} |",
                    flush=True,
                )
    print(f"\nlargest deviation of the estimate: {worst:.0%}")


def growth(args: argparse.Namespace) -> None:
    gib = 2**30
    if any(w & (w - 1) for w in args.widths):
        raise SystemExit(f"--widths {args.widths}: each must be 0 (exact) or a power of two")
    runs = {}
    for widths in args.widths:
        spec = {"passes": args.growth, "widths": widths, "precision": args.precision, "seed": 0}
        got = measure(spec, args.allocator)
        if "error" in got:
            raise SystemExit(f"widths {widths}: {got['error']}")
        runs[widths] = got
    names = {w: "exact widths" if w == 0 else f"{w} widths per doubling" for w in runs}
    print(f"SmolLM2-135M-Instruct, {args.precision} compute, checkpointing and chunked logprobs,")
    print(f"{args.allocator} malloc; resident memory after each training pass on packed rows of 8 to 40")
    print("sequences (the same rows in every column, one fresh process per column)")
    print("| pass | tokens | " + " | ".join(f"{names[w]} GiB, s" for w in runs) + " |")
    print("|---|---|" + "---|" * len(runs))
    first = next(iter(runs.values()))
    for i, tokens in enumerate(first["tokens"]):
        cells = [f"{r['rss'][i] / gib:.3f}, {r['seconds'][i]:.1f}" for r in runs.values()]
        print(f"| {i + 1} | {tokens:,} | " + " | ".join(cells) + " |")
    for w, r in runs.items():
        grown = f"pass 3 to {args.growth}: {(r['rss'][-1] - r['rss'][2]) / gib:+.3f} GiB"
        later = f"passes 3 to {args.growth}: {sum(r['seconds'][2:]):.0f} s"
        print(f"{names[w]}: {grown}; {later}" if args.growth > 3 else names[w])


def steps(args: argparse.Namespace) -> None:
    out = scratch_dir("rlfleet-memory-")
    cmd = [
        sys.executable, "-m", "rlfleet.cli", "grpo", "grpo-smollm2-135m-arithmetic-cpu",
        f"grpo.max_num_steps={args.steps}", "grpo.val_period=0", "grpo.val_at_start=false",
        f"logger.log_dir={out}/logs", f"checkpointing.checkpoint_dir={out}/ckpt",
        "checkpointing.enabled=false",
        *args.overrides,
    ]  # fmt: skip
    print("running:", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)
    from rlfleet.logging import read_metrics

    rows = read_metrics(out / "logs")
    # a step's peak covers what ran since the previous step's metrics: its validation and checkpoint too
    print(
        "| step | trainer RSS after step GiB | trainer peak RSS since last step GiB | step s | ran before |"
    )
    print("|---|---|---|---|---|")
    before = ""
    for r in rows:
        if "memory/trainer_rss_gib" in r:
            seconds = r.get("timing/total", float("nan"))
            print(
                f"| {r.get('step')} | {r['memory/trainer_rss_gib']:.2f} | "
                f"{r['memory/trainer_peak_rss_gib']:.2f} | {seconds:.1f} | {before} |"
            )
        ran = [name for name in ("validation", "checkpoint") if f"timing/{name}" in r]
        before = " + ".join(ran)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--recipe", default=RECIPE, help="the grid's model: the recipe's (sft-gemma3-270m-gsm8k-cpu: Gemma 3)"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 10240, 16384])
    parser.add_argument("--logprob-tokens", type=int, nargs="+", default=[4096, 20480])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--passes", nargs="+", choices=["train", "logprob"], default=["train", "logprob"])
    parser.add_argument("--precision", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--allocator",
        default="jemalloc",
        choices=["jemalloc", "glibc"],
        help="the children's malloc (jemalloc, as the rlfleet command runs where one is installed)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="the grid's passes with policy.torch_compile (the recipes' fast path; the warm-up compiles)",
    )
    parser.add_argument("--steps", type=int, help="train the SmolLM2 arithmetic recipe N steps instead")
    parser.add_argument(
        "--growth", type=int, help="N training passes on varied packed rows: resident memory after each"
    )
    parser.add_argument(
        "--widths", type=int, nargs="+", default=[0, 16],
        help="packed widths per doubling for --growth, one column each (0: exact widths)",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="recipe overrides for --steps")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(growth_child(spec) if "passes" in spec else child(spec)))
    elif args.growth:
        growth(args)
    elif args.steps:
        steps(args)
    else:
        grid(args)


if __name__ == "__main__":
    main()
