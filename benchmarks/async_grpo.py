"""Asynchronous GRPO against the synchronous loop, side by side in one run (issue 11).

Both rows run the embedded default GRPO recipe on Ray with 1 training worker and 1 dedicated generation
worker (``cluster.gpus_per_node=2``, ``policy.generation.colocated.enabled=false``; on CPU each is one Ray
actor with one core), from the same SFT start (``runs/demo/sft_model``, else one built like
``benchmarks/algorithms.py`` builds it) and the same seeds, with the importance-sampling correction on
(truncated at 2) in both, so the only difference is ``grpo.async_grpo.enabled``:

- sync: generate and score step k's batch, train on it, refit the engine;
- async: step k trains on the batch generated during step k - 1 (one policy version old) while the engine
  generates step k + 1's; then the refit.

It prints the mean step time over steps 2..N (step 1 has nothing to overlap), the mean generation, training
and waiting times, the speed-up, and greedy validation accuracy before and after (equal within noise is
the claim; the async batches are one version stale).

    .venv/bin/python benchmarks/async_grpo.py                 # 20 steps per row
    .venv/bin/python benchmarks/async_grpo.py --steps 4 --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from rlfleet.config import load_recipe, resolve_recipe_path
from rlfleet.demo import GRPO_RECIPE, stage_overrides

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithms import QUICK, choose_start, timed_run  # the SFT start shared with the variants table

LAYOUT = (
    "cluster.use_ray=true",
    "cluster.gpus_per_node=2",
    "policy.generation.colocated.enabled=false",
    "policy.generation.colocated.resources.num_nodes=1",
    "policy.generation.colocated.resources.gpus_per_node=1",
    "loss_fn.use_importance_sampling_correction=true",
    "loss_fn.truncated_importance_sampling_ratio=2.0",
)


def run(name: str, model: Path, out: Path, steps: int, extra: list[str]) -> dict[str, float]:
    overrides = [
        *stage_overrides(out, name, model),
        *LAYOUT,
        f"grpo.async_grpo.enabled={'true' if name == 'async' else 'false'}",
        f"grpo.max_num_steps={steps}",
        "grpo.val_period=0",
        "checkpointing.enabled=false",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
        "logger.num_samples_to_log=0",
        *extra,
    ]
    cfg = load_recipe(resolve_recipe_path(GRPO_RECIPE), overrides)
    wall, records, val = timed_run(cfg)
    later = [r for r in records if "timing/training" in r][1:]  # step 1 has nothing to overlap

    def mean(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in later) if later else float("nan")

    return {
        "step_s": mean("timing/total"),
        "generation_s": mean("timing/generation"),
        "training_s": mean("timing/training") + mean("timing/logprobs"),
        "wait_s": mean("timing/generation_wait"),
        "refit_s": mean("timing/refit"),
        "before": val[0],
        "after": val[-1],
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="SFT start (default: runs/demo/sft_model, else built under --out)")
    parser.add_argument("--out", default=None, help="where runs go (default: a temporary directory)")
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps per row (default 20)")
    parser.add_argument("--quick", action="store_true", help="smoke run: small batches, short validation")
    parser.add_argument("overrides", nargs="*", help="overrides applied to both rows")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (step 1 has nothing to overlap)")
    out = Path(args.out or tempfile.mkdtemp(prefix="rlfleet-async-")).resolve()
    model = choose_start(args.model, out, args.quick)
    extra = [*(QUICK if args.quick else ()), *args.overrides]
    rows = {}
    for name in ("sync", "async"):
        print(f"== {name}: {args.steps} steps from {model}", flush=True)
        rows[name] = run(name, model, out, args.steps, extra)
    print(f"\nGRPO on Ray, 1 training + 1 dedicated generation worker, {args.steps} steps, {GRPO_RECIPE}")
    print(
        "| loop  | s/step (2..N) | generation s | logprobs+training s | wait s | refit s "
        "| val before | val after |"
    )
    print(
        "|-------|---------------|--------------|---------------------|--------|---------|------------|-----------|"
    )
    for name, r in rows.items():
        print(
            f"| {name:<5} | {r['step_s']:>13.2f} | {r['generation_s']:>12.2f} | {r['training_s']:>19.2f} | "
            f"{r['wait_s']:>6.2f} | {r['refit_s']:>7.2f} | {r['before']:>10.1%} | {r['after']:>9.1%} |"
        )
    print(f"\nasync speed-up per step: {rows['sync']['step_s'] / rows['async']['step_s']:.2f}x")


if __name__ == "__main__":
    main()
