"""Peak memory of the logprob and training passes: measured against `rlfleet plan`'s estimate.

Each row runs in a fresh child process: SmolLM2-135M-Instruct (bf16 compute, float32 master weights and
AdamW state, as the SmolLM2 recipes run on a CPU with native bf16), one small warm-up training pass (so the
AdamW moments exist, as in a run), then the measured pass twice on one packed micro-batch of ``tokens``
tokens (rows of 96 prompt + 160 response tokens). "measured" is the child's peak resident memory (Linux
``VmHWM``, reset after the warm-up) over both; "estimated" is the sum of the parts ``rlfleet plan`` prints
for the same layout (``rlfleet.memory_plan.memory_plan`` on the recipe with these overrides). Rows whose
estimate exceeds 75% of the available memory are not run (the run would refuse them, or risk the OOM
killer). On a GPU, ``torch.cuda.max_memory_allocated`` replaces resident memory and no process or heap
term is estimated.

``--steps N`` instead trains the SmolLM2 arithmetic recipe for N steps and prints the trainer's resident
memory after each step (``memory/trainer_rss_gib`` and ``memory/trainer_peak_rss_gib`` of its metrics).

    python benchmarks/memory.py                          # the grid (about 20 minutes on 2 cores)
    python benchmarks/memory.py --tokens 1024 4096 --modes plain ckpt+chunk
    python benchmarks/memory.py --steps 20               # resident memory per step of a real run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

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


def estimate(mode: str, pass_: str, tokens: int, precision: str, allocator: str) -> dict[str, float]:
    from rlfleet.config import load_recipe, resolve_recipe_path
    from rlfleet.config.layout import resource_layout
    from rlfleet.memory_plan import count_parameters, memory_plan

    cfg = load_recipe(resolve_recipe_path(RECIPE), overrides(mode, pass_, tokens, precision))
    assert cfg.policy.architecture is not None
    n = count_parameters(cfg.policy.architecture)
    plan = memory_plan(cfg, resource_layout(cfg), n, n, allocator=allocator)
    return plan.passes[pass_] | {"_available": float(plan.available or 0)}


def child(spec: dict) -> dict:
    """One measured row, in this (fresh) process."""
    import torch

    from rlfleet.config import load_recipe, resolve_recipe_path
    from rlfleet.models.loading import ModelSource
    from rlfleet.policy.batch import collate
    from rlfleet.policy.loss_functions import ClippedPGLossFn
    from rlfleet.policy.microbatch import MicroBatching
    from rlfleet.policy.worker import OptimizerSettings, PolicyWorker
    from rlfleet.utils.allocator import running_allocator
    from rlfleet.utils.memory import release_free_memory, take_peak_resident_bytes

    cfg = load_recipe(resolve_recipe_path(RECIPE), overrides(spec["mode"], spec["pass"], 256, "bfloat16"))
    ckpt, chunk = MODES[spec["mode"]]
    settings = OptimizerSettings(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, max_grad_norm=1.0)
    source = ModelSource(cfg.policy.model_name, spec["precision"], cfg.policy.gguf_file)
    worker = PolicyWorker(source, settings, keep_reference=False, activation_checkpointing=ckpt)
    loss = ClippedPGLossFn(
        eps_low=0.2, eps_high=0.2, dual_clip_c=None, kl_penalty=0.0, kl_input_clamp=20.0,
        kl_output_clamp=10.0, token_level=True, importance_sampling_correction=False,
        prev_from_training_forward=True,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)

    def batch_of(tokens: int):
        rows = max(tokens // sum(ROW), 1)
        vocab = worker.tokenizer.vocab_size
        prompts = [torch.randint(3, vocab - 1, (ROW[0],), generator=gen).tolist() for _ in range(rows)]
        responses = [torch.randint(3, vocab - 1, (ROW[1],), generator=gen).tolist() for _ in range(rows)]
        batch = collate(prompts, responses, worker.tokenizer.pad_token_id or 0)
        return batch.with_(advantages=torch.randn(rows, generator=gen))

    def run(tokens: int, pass_: str) -> None:
        batch = batch_of(tokens)
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


def child_env(allocator: str) -> dict[str, str]:
    """The environment of a measured child: on jemalloc as ``rlfleet`` runs one, or on glibc's malloc."""
    from rlfleet.utils.allocator import ENV, reexec_argv

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
    print(f"SmolLM2-135M-Instruct, {args.precision} compute, packed rows of {sum(ROW)} tokens,")
    print(f"{args.allocator} malloc; peak resident memory in a fresh process against rlfleet plan's estimate")
    print("| pass | tokens | mode | estimated GiB | measured GiB | estimate / measured | s per 1k tokens |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for pass_ in args.passes:
        for tokens in args.tokens if pass_ == "train" else args.logprob_tokens:
            for mode in args.modes:
                parts = estimate(mode, pass_, tokens, args.precision, args.allocator)
                available = parts.pop("_available")
                est = sum(parts.values())
                row = f"| {pass_} | {tokens:,} | {mode} | {est / gib:.2f} |"
                if available and est > 0.75 * available:
                    print(f"{row} not run (over 75% of {available / gib:.1f} GiB available) | | |")
                    continue
                spec = {"mode": mode, "pass": pass_, "tokens": tokens, "precision": args.precision}
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


def steps(args: argparse.Namespace) -> None:
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="rlfleet-memory-"))
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
    print("| step | trainer RSS after step GiB | trainer peak RSS during step GiB | step s |")
    print("|---|---|---|---|")
    for r in rows:
        if "memory/trainer_rss_gib" in r:
            print(
                f"| {r.get('step')} | {r['memory/trainer_rss_gib']:.2f} | "
                f"{r['memory/trainer_peak_rss_gib']:.2f} | {r.get('timing/total', float('nan')):.1f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
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
    parser.add_argument("--steps", type=int, help="train the SmolLM2 arithmetic recipe N steps instead")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for --steps")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
    elif args.steps:
        steps(args)
    else:
        grid(args)


if __name__ == "__main__":
    main()
