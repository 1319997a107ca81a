"""Does the tiny model learn to use a calculator? The multi-turn tool task, from one script, same seeds.

The task (``data.dataset_name=multiplication``): "What is 3471 * 1791?", 3-4 digit operands, a product the
tiny model cannot compute. Rows, each greedy on the same 128 held-out problems:

    no tool, SFT      SFT on the product written out (``sft_target=direct``), answered in one turn: the
                      ceiling of the model without the tool
    tool, SFT         SFT on calculator episodes (``sft-tiny-multiplication-tools-cpu``), then episodes with
                      the ``tools`` environment (up to 3 turns)
    tool, SFT + GRPO  multi-turn GRPO from that model (``grpo-tiny-multiplication-tools-cpu``)

with tool calls and tool errors per episode, and wall time. Every stage writes under ``--out`` and is reused
when it is already there (delete the folder to start over).

    .venv/bin/python benchmarks/environments.py                  # the recipes as shipped (~15 min on 2 cores)
    .venv/bin/python benchmarks/environments.py --quick          # a smoke run: a few steps per stage
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

from rlfleet.algorithms.grpo.loop import grpo_train
from rlfleet.algorithms.sft.loop import sft_train
from rlfleet.checkpoint import CheckpointManager, export_hf
from rlfleet.config import MasterConfig, load_recipe, resolve_recipe_path
from rlfleet.demo import ensure_tiny_model, stage_overrides
from rlfleet.logging import read_metrics
from rlfleet.runtime.eval_command import run_eval

SFT = "sft-tiny-multiplication-tools-cpu"
GRPO = "grpo-tiny-multiplication-tools-cpu"


def sft_model(out: Path, name: str, base: Path, overrides: list[str]) -> tuple[Path, float]:
    """SFT from ``base`` (skipped when done); the exported model and the seconds it took."""
    model = out / f"{name}_model"
    start = time.perf_counter()
    if not (model / "config.json").is_file():
        cfg = load_recipe(resolve_recipe_path(SFT), [*stage_overrides(out, name, base), *overrides])
        sft_train(cfg)
        latest = CheckpointManager(Path(cfg.checkpointing.checkpoint_dir), None, True, None).latest()
        assert latest is not None, "SFT wrote no checkpoint"
        export_hf(latest, model)
    return model, time.perf_counter() - start


def evaluate(cfg: MasterConfig, name: str, out: Path) -> dict[str, float]:
    samples = out / f"{name}.samples.jsonl"
    report = run_eval(cfg, samples_path=samples)
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    calls = [r.get("tool_calls", 0.0) for r in rows]
    errors = [r.get("tool_errors", 0.0) for r in rows]
    return {
        "accuracy": report.pass_at_1,
        "tool_calls": sum(calls) / max(len(rows), 1),
        "tool_errors": sum(errors) / max(len(rows), 1),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench_environments"))
    parser.add_argument("--quick", action="store_true", help="a smoke run: a few steps per stage")
    parser.add_argument("--sft-steps", type=int, help="SFT steps of both warm starts (default: the recipe's)")
    parser.add_argument(
        "--grpo", nargs="*", default=[], help="overrides of the GRPO stage (grpo.max_num_steps=60)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    out: Path = args.out.resolve()
    # quick: each SFT 2 steps, validated once at its end; GRPO 2 steps of 2 x 4 episodes, validated at its
    # start and end
    sft_quick = ["sft.max_num_steps=2", "sft.val_period=2", "sft.val_at_start=false"]
    quick = [*sft_quick, "data.multiplication.num_val=8"] if args.quick else []
    if args.sft_steps is not None and not args.quick:
        quick = [f"sft.max_num_steps={args.sft_steps}"]
    grpo_quick = (
        [
            "grpo.max_num_steps=2",
            "grpo.val_period=2",
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=4",
            "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=8",
        ]
        if args.quick
        else []
    )
    eval_keys = ["eval.num_tests_per_prompt=1", "eval.max_val_samples=128"]

    cfg = load_recipe(resolve_recipe_path(SFT), [*stage_overrides(out, "sft_tool", out), *quick])
    base = ensure_tiny_model(out / "base_model", cfg, seed=cfg.sft.seed)
    rows: list[tuple[str, dict[str, float], float]] = []

    direct, seconds = sft_model(out, "sft_direct", base, ["data.multiplication.sft_target=direct", *quick])
    start = time.perf_counter()
    no_tool = load_recipe(resolve_recipe_path(SFT), [f"policy.model_name={direct}", *quick, *eval_keys])
    rows.append(("no tool, SFT", evaluate(no_tool, "no_tool", out), seconds + time.perf_counter() - start))

    tool, seconds = sft_model(out, "sft_tool", base, quick)
    start = time.perf_counter()
    with_tool = load_recipe(resolve_recipe_path(GRPO), [f"policy.model_name={tool}", *quick, *eval_keys])
    rows.append(("tool, SFT", evaluate(with_tool, "tool_sft", out), seconds + time.perf_counter() - start))

    start = time.perf_counter()
    grpo_cfg = load_recipe(
        resolve_recipe_path(GRPO), [*stage_overrides(out, "grpo", tool), *quick, *grpo_quick, *args.grpo]
    )
    grpo_train(grpo_cfg)
    after = grpo_cfg.checkpointing.checkpoint_dir
    latest = CheckpointManager(Path(after), None, True, None).latest()
    assert latest is not None, "GRPO wrote no checkpoint"
    grpo_model = out / "grpo_model"
    if not (grpo_model / "config.json").is_file():
        export_hf(latest, grpo_model)
    final = load_recipe(resolve_recipe_path(GRPO), [f"policy.model_name={grpo_model}", *quick, *eval_keys])
    rows.append(("tool, SFT + GRPO", evaluate(final, "tool_grpo", out), time.perf_counter() - start))

    print(f"\n{'row':<18} {'val accuracy':>12} {'tool calls/ep':>13} {'tool errors/ep':>14} {'wall s':>8}")
    for name, result, wall in rows:
        print(
            f"{name:<18} {result['accuracy']:>12.1%} {result['tool_calls']:>13.2f} "
            f"{result['tool_errors']:>14.2f} {wall:>8.0f}"
        )
    curve = [
        (r["step"], r["val/accuracy"])
        for r in read_metrics(Path(grpo_cfg.logger.log_dir))
        if "val/accuracy" in r
    ]
    print("GRPO validation curve (step, accuracy):", ", ".join(f"({s}, {a:.3f})" for s, a in curve))


if __name__ == "__main__":
    main()
