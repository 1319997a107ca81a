"""GRPO step time by phase: one process vs Ray with 1 and 2 training workers and dedicated generation.

Runs the embedded default recipe (32 prompts x 8 samples, tiny model) for a few steps in each layout, in
one invocation, and prints seconds per phase (mean over steps, the first excluded as warm-up) with each
layout's total as a ratio of the single process. Ray workers use one torch thread each; the single
process uses the machine's default. On a 2-core machine two workers can at best match one process.

    .venv/bin/python benchmarks/ray_scaling.py --model runs/demo/sft_model --steps 4
"""

from __future__ import annotations

import argparse

import torch

from grpo_step_phases import PHASES, phase_table

RAY = ["cluster.use_ray=true"]
DEDICATED = [
    "policy.generation.colocated.enabled=false",
    "policy.generation.colocated.resources.num_nodes=1",
    "policy.generation.colocated.resources.gpus_per_node=1",
]
LAYOUTS = {
    "1 process (no Ray)": [],
    "Ray: 1 worker": RAY,
    "Ray: 2 FSDP workers": [*RAY, "cluster.gpus_per_node=2"],
    "Ray: 1 train + 1 gen": [*RAY, "cluster.gpus_per_node=2", *DEDICATED],
}
EXTRA = (
    ("gen tok/s/wk", "perf/generation_tokens_per_s_per_worker", ".0f"),
    ("gen imbal", "perf/generation_imbalance", ".2f"),
    ("train imbal", "perf/training_imbalance", ".2f"),
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="runs/demo/sft_model", help="model dir (make train creates this)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", nargs="*", help="layout names to run (default: all)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    tables = {}
    for name, layout in LAYOUTS.items():
        if args.only and name not in args.only:
            continue
        tables[name], _ = phase_table(args.model, args.steps, [*layout, *args.overrides])
    base = next(iter(tables.values()))["total"]
    cores = torch.get_num_threads()
    print(f"\nGRPO step seconds by phase ({args.steps - 1} steps after warm-up; {cores} torch threads)")
    head = f"{'layout':<24}" + "".join(f"{p[:8]:>9}" for p in PHASES) + f"{'ratio':>7}"
    head += "".join(f"{label:>14}" for label, _, _ in EXTRA)
    print(head)
    for name, table in tables.items():
        row = f"{name:<24}" + "".join(f"{table[p]:>9.3f}" for p in PHASES) + f"{table['total'] / base:>7.2f}"
        row += "".join(f"{format(table[key], fmt) if key in table else '-':>14}" for _, key, fmt in EXTRA)
        print(row)


if __name__ == "__main__":
    main()
