"""Where a GRPO step's time goes, and how our generation path compares with a bare HF ``generate`` call.

Runs a few GRPO steps of the embedded default recipe from a given model and prints a table of seconds per
phase (mean over steps, the first step excluded as warm-up), then times the same rollout batch through
``HFGenerationBackend`` and through a hand-written ``model.generate`` call on the same model, batch and
sampling settings, and prints their ratio.

    .venv/bin/python benchmarks/grpo_step_phases.py --model runs/demo/sft_model --steps 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: benchmarks/ importable

from benchmarks.scratch import scratch_dir

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.config import load_recipe, quote_override_value, resolve_recipe_path
from rlfleet.generation import SamplingParams
from rlfleet.logging import read_metrics

PHASES = ("generation", "reward", "logprobs", "training", "refit", "checkpoint", "total")


def phase_table(
    model: str, steps: int, extra: list[str], always_compute_prev: bool = False
) -> tuple[dict[str, float], GRPO]:
    run_dir = scratch_dir("rlfleet-bench-")
    overrides = [
        f"policy.model_name={quote_override_value(model)}",
        f"checkpointing.checkpoint_dir={quote_override_value(str(run_dir / 'ckpt'))}",
        f"logger.log_dir={quote_override_value(str(run_dir / 'logs'))}",
        f"grpo.max_num_steps={steps}",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "checkpointing.enabled=false",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
        *extra,
    ]
    cfg = load_recipe(resolve_recipe_path("grpo-tiny-arithmetic-cpu"), overrides)
    trainer = GRPO(cfg, always_compute_prev=always_compute_prev)
    trainer.train()
    records = [r for r in read_metrics(run_dir / "logs") if "timing/total" in r][1:]  # drop warm-up step
    table = {p: statistics.mean(r.get(f"timing/{p}", 0.0) for r in records) for p in PHASES}
    table["tokens/s"] = statistics.mean(r["train/num_tokens"] / r["timing/total"] for r in records)
    perf_keys = sorted({k for r in records for k in r if k.startswith("perf/")})
    table.update({k: statistics.mean(r.get(k, 0.0) for r in records) for k in perf_keys})
    return table, trainer


def generation_ratio(trainer: GRPO, repeats: int) -> tuple[float, float]:
    """Seconds per rollout batch: our backend vs a bare ``model.generate`` on identical inputs."""
    cfg, backend = trainer.cfg, trainer.backend
    n = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    prompts = [p.token_ids for p in trainer.data.val[: cfg.grpo.num_prompts_per_step]]
    prompts = [p for p in prompts for _ in range(cfg.grpo.num_generations_per_prompt)][:n]
    params = SamplingParams(cfg.policy.generation.max_new_tokens, cfg.policy.generation.temperature)
    tok, model = trainer.ctx.policy.tokenizer, trainer.ctx.policy.model
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + list(p) for p in prompts])
    mask = (torch.arange(width)[None, :] >= (width - torch.tensor([len(p) for p in prompts]))[:, None]).long()

    def ours() -> None:
        backend.generate(prompts, params, seed=0)

    @torch.no_grad()
    def bare() -> None:
        torch.manual_seed(0)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=params.temperature,
            top_k=0,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )

    timings = {}
    for name, fn in (("rlfleet", ours), ("bare", bare)):
        fn()  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        timings[name] = (time.perf_counter() - start) / repeats
    return timings["rlfleet"], timings["bare"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="runs/demo/sft_model", help="model dir (make train creates this)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--always-compute-prev",
        action="store_true",
        help="compute the prev logprobs in a separate pass even when the step is one on-policy update",
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    table, trainer = phase_table(args.model, args.steps, args.overrides, args.always_compute_prev)
    total = table["total"]
    print(
        f"\nGRPO step phases ({args.steps - 1} steps after warm-up, torch threads={torch.get_num_threads()})"
    )
    print(f"{'phase':<12} {'seconds':>8} {'share':>7}")
    for phase in PHASES:
        print(f"{phase:<12} {table[phase]:>8.3f} {table[phase] / total:>7.1%}")
    print(f"{'tokens/s':<12} {table['tokens/s']:>8.0f}")
    ours, bare = generation_ratio(trainer, args.repeats)
    print("\nrollout generation, same model/batch/sampling")
    print(f"{'path':<28} {'s/batch':>8} {'ratio':>7}")
    print(f"{'bare model.generate':<28} {bare:>8.3f} {1.0:>7.2f}")
    print(f"{'HFGenerationBackend':<28} {ours:>8.3f} {ours / bare:>7.2f}")


if __name__ == "__main__":
    main()
