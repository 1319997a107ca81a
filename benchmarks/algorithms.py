"""GRPO and its variants side by side on the embedded default task: does each one learn, and at what cost?

Every row starts from the same SFT model (the one ``make train`` / ``rlfleet demo`` writes to
``runs/demo/sft_model``, or one this script builds the same way under ``--out``) and runs the embedded
default GRPO recipe (``grpo-tiny-arithmetic-cpu``) with the same seeds, changing only the variant's keys:

    GRPO      the recipe as shipped (token-level loss, leave-one-out baseline, std normalisation, k3 KL)
    DAPO      + dynamic sampling (batch_multiplier 1.5, <= 3 rounds), overlong reward shaping (last quarter of
              max_new_tokens), clip-higher (ratio_clip_max 0.28)
    Dr.GRPO   no std normalisation, token sums / max_new_tokens (constant normaliser)
    GSPO      sequence-level ratio clipped at 3e-4 / 4e-4, per-sequence loss
    GRPO+LoRA policy.dtensor_cfg.lora_cfg.enabled=true, lr 1e-3 (with --lora; skipped, saying why, where
              this build's schema has no LoRA key)

It prints one table: greedy validation accuracy before (step 0) and after, the gain, wall time, the
tokens trained (prompt + response tokens of the rows that went through the optimizer), and the mean
response length over the training steps.

    .venv/bin/python benchmarks/algorithms.py                    # 80 steps per row from runs/demo/sft_model
    .venv/bin/python benchmarks/algorithms.py --steps 40 --lora
    .venv/bin/python benchmarks/algorithms.py --quick            # a smoke run: tiny model, 2 steps per row

With the recipe's one optimizer step per GRPO step (``train_global_batch_size`` = P x G) the policy that
sampled is the one being trained, so every ratio is 1 and GSPO's clip never binds: GSPO differs from GRPO
here only in its per-sequence aggregation; its clip matters with several optimizer steps per batch.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.algorithms.sft.loop import sft_train
from rlfleet.checkpoint import CheckpointManager, export_hf
from rlfleet.config import MasterConfig, load_recipe, resolve_recipe_path, schema_keys
from rlfleet.demo import GRPO_RECIPE, SFT_RECIPE, ensure_tiny_model, stage_overrides
from rlfleet.logging import read_metrics

LORA_KEY = "policy.dtensor_cfg.lora_cfg.enabled"

VARIANTS: dict[str, tuple[str, ...]] = {
    "GRPO": (),
    "DAPO": (
        "grpo.use_dynamic_sampling=true",
        "grpo.batch_multiplier=1.5",
        "grpo.dynamic_sampling_max_gen_batches=3",
        "grpo.reward_shaping.enabled=true",
        "loss_fn.ratio_clip_max=0.28",
    ),
    "Dr.GRPO": (
        "grpo.normalize_rewards=false",
        "loss_fn.token_level_loss=false",
        "loss_fn.max_length_normalization=true",
    ),
    "GSPO": (
        "loss_fn.sequence_level_importance_ratios=true",
        "loss_fn.token_level_loss=false",
        "loss_fn.ratio_clip_min=3e-4",
        "loss_fn.ratio_clip_max=4e-4",
    ),
    # adapters (dim 8, alpha 32) move far less per step than full weights: a 10x learning rate
    "GRPO+LoRA": (f"{LORA_KEY}=true", "policy.optimizer.kwargs.lr=1e-3"),
}

QUICK = (
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_val_samples=16",
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=16",
    "policy.logprob_batch_size=16",
    "policy.generation.max_new_tokens=24",
    "env.math.num_workers=1",
)


@dataclass(frozen=True)
class Row:
    name: str
    before: float
    after: float
    wall_s: float
    tokens: int
    response_length: float
    note: str = ""


def sft_start(out: Path, quick: bool) -> Path:
    """The SFT model every row starts from, built as ``rlfleet demo`` builds it (reused when present)."""
    model = out / "sft_model"
    if (model / "config.json").is_file():
        return model
    short = ["sft.max_num_steps=3", "sft.max_val_samples=8", "env.math.num_workers=1"] if quick else []
    quiet = ["logger.tensorboard_enabled=false", "logger.progress_bar=false"]
    cfg = load_recipe(resolve_recipe_path(SFT_RECIPE), [*stage_overrides(out, "sft", out), *short, *quiet])
    base = ensure_tiny_model(out / "base_model", cfg, seed=cfg.sft.seed)
    cfg = load_recipe(resolve_recipe_path(SFT_RECIPE), [*stage_overrides(out, "sft", base), *short, *quiet])
    print(f"building the SFT start from {base}", flush=True)
    sft_train(cfg)
    latest = CheckpointManager(Path(cfg.checkpointing.checkpoint_dir), None, True, None).latest()
    if latest is None:
        raise RuntimeError(f"SFT wrote no checkpoint under {cfg.checkpointing.checkpoint_dir}")
    export_hf(latest, model)
    return model


def choose_start(model: str | None, out: Path, quick: bool) -> Path:
    """``--model``, else ``runs/demo/sft_model`` when ``make train`` wrote it, else an SFT start built under
    ``out`` (a 3-step one with ``quick``)."""
    demo_model = Path("runs/demo/sft_model")
    if model:
        return Path(model).resolve()
    if not quick and (demo_model / "config.json").is_file():
        return demo_model.resolve()
    return sft_start(out, quick)


def timed_run(cfg: MasterConfig) -> tuple[float, list[dict], list[float]]:
    """Runs GRPO as configured: (wall seconds, the logged metrics, the validation accuracies in order)."""
    start = time.perf_counter()
    GRPO(cfg).train()
    wall = time.perf_counter() - start
    records = read_metrics(Path(cfg.logger.log_dir))
    return wall, records, [r["val/accuracy"] for r in records if r.get("val/accuracy") is not None]


def run_variant(name: str, model: Path, run_dir: Path, steps: int, extra: list[str]) -> Row:
    overrides = [
        *stage_overrides(run_dir, name, model),
        f"grpo.max_num_steps={steps}",
        "grpo.val_period=0",
        "grpo.val_at_start=true",
        "grpo.val_at_end=true",
        "checkpointing.enabled=false",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
        "logger.num_samples_to_log=0",
        *extra,
        *VARIANTS[name],
    ]
    cfg = load_recipe(resolve_recipe_path(GRPO_RECIPE), overrides)
    if name == "DAPO":  # the overlong buffer: the last quarter of the response budget
        buffer = max(1, cfg.policy.generation.max_new_tokens // 4)
        overrides.append(f"grpo.reward_shaping.overlong_buffer_length={buffer}")
        cfg = load_recipe(resolve_recipe_path(GRPO_RECIPE), overrides)
    wall, records, val = timed_run(cfg)
    steps_done = [r for r in records if "train/num_tokens" in r]
    skipped = int(sum(r.get("train/update_skipped", 0.0) for r in steps_done))
    notes = [f"{skipped} update(s) skipped"] if skipped else []
    if name == "DAPO":
        filled = int(sum(r["train/dynamic_sampling_filled"] for r in steps_done))
        rounds = int(sum(r["train/dynamic_sampling_rounds"] for r in steps_done))
        notes.append(f"{filled}/{len(steps_done)} steps filled, {rounds} generation rounds")
    return Row(
        name,
        before=val[0],
        after=val[-1],
        wall_s=wall,
        tokens=int(sum(r["train/num_tokens"] for r in steps_done)),
        response_length=statistics.mean(r["train/mean_response_length"] for r in steps_done),
        note="; ".join(notes),
    )


def format_table(rows: list[Row], skipped: dict[str, str]) -> str:
    head = f"| {'variant':<10} | {'val before':>10} | {'val after':>9} | {'gain':>7} | {'wall s':>7} | "
    head += f"{'tokens trained':>14} | {'mean resp len':>13} | note"
    lines = [head, "|" + "|".join("-" * (len(c) + 2) for c in head.strip("| ").split(" | "))]
    for r in rows:
        lines.append(
            f"| {r.name:<10} | {r.before:>10.1%} | {r.after:>9.1%} | {(r.after - r.before) * 100:>+6.1f}p | "
            f"{r.wall_s:>7.1f} | {r.tokens:>14,} | {r.response_length:>13.1f} | {r.note}"
        )
    lines += [f"| {name:<10} | skipped: {reason}" for name, reason in skipped.items()]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="SFT start (default: runs/demo/sft_model, else built under --out)")
    parser.add_argument("--out", default=None, help="where runs go (default: a temporary directory)")
    parser.add_argument(
        "--steps", type=int, default=None, help="GRPO steps per row (default 80; 2 with --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: small batches, short validation")
    parser.add_argument("--lora", action="store_true", help="add the GRPO+LoRA row")
    parser.add_argument("--variants", nargs="*", default=None, help=f"rows to run (of {', '.join(VARIANTS)})")
    parser.add_argument("overrides", nargs="*", help="overrides applied to every row")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.variants or ()) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; the rows are {', '.join(VARIANTS)}")
    if args.steps is None:
        args.steps = 2 if args.quick else 80
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="rlfleet-algorithms-")).resolve()
    model = choose_start(args.model, out, args.quick)
    steps = args.steps
    names = args.variants or [n for n in VARIANTS if n != "GRPO+LoRA" or args.lora]
    extra = [*(QUICK if args.quick else ()), *args.overrides]
    rows, skipped = [], {}
    for name in names:
        if name == "GRPO+LoRA" and LORA_KEY not in schema_keys():
            skipped[name] = f"this build's schema has no {LORA_KEY}"
            print(f"== {name}: skipped ({skipped[name]})", flush=True)
            continue
        print(f"== {name}: {steps} steps from {model}", flush=True)
        rows.append(run_variant(name, model, out, steps, extra))
    print(f"\nGRPO variants on {GRPO_RECIPE}, {steps} steps each, same SFT start ({model}) and seeds")
    print(format_table(rows, skipped))


if __name__ == "__main__":
    main()
