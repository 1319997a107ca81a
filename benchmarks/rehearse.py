"""Every shipped GPU recipe rehearsed at its real scale on this machine: ``rlfleet rehearse`` for each recipe
whose model is a hub model with a shipped configuration (``src/rlfleet/config/model_configs``), its per-rank
table printed, then one summary row per recipe: the rehearsed peak of a training rank, ``plan``'s estimate,
their ratio, and the time the rehearsal took here.

    python benchmarks/rehearse.py                    # every GPU recipe (about 2 minutes on 2 cores)
    python benchmarks/rehearse.py --recipes grpo-qwen2.5-0.5b-gsm8k-1n1g
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from rlfleet.config import load_recipe, recipe_algorithm
from rlfleet.config.architectures import shipped_model_config
from rlfleet.config.layout import resource_layout
from rlfleet.runtime.rehearse import GB, format_rehearsal, plan_estimate, rehearse

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def gpu_recipes() -> list[str]:
    """The shipped recipes whose model has a shipped configuration (the ones meant for GPUs)."""
    return [
        path.stem
        for path in sorted(RECIPES.glob("*.yaml"))
        if shipped_model_config(load_recipe(path).policy.model_name) is not None
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipes", nargs="*", help="recipe names (default: every GPU recipe)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    rows = []
    for name in args.recipes or gpu_recipes():
        path = RECIPES / f"{name}.yaml"
        cfg = load_recipe(path)
        cfg = cfg.model_copy(update={"algorithm": recipe_algorithm(path)})
        start = time.perf_counter()
        results = rehearse(cfg)
        seconds = time.perf_counter() - start
        print(format_rehearsal(cfg, name, results), end="\n\n", flush=True)
        estimate = plan_estimate(cfg, resource_layout(cfg))
        for result in results:
            rows.append((name, result["role"], result["peak"], estimate, seconds))
    print(f"{'recipe':<48}{'rank':<40}{'rehearsed':>10}{'plan':>8}{'ratio':>7}{'time':>8}")
    for name, role, peak, estimate, seconds in rows:
        plan = f"{estimate / GB:.1f}" if estimate else "-"
        ratio = f"{peak / estimate:.2f}" if estimate else "-"
        print(f"{name:<48}{role:<40}{peak / GB:>10.1f}{plan:>8}{ratio:>7}{seconds:>7.0f}s")
    print("(GB = 10^9 bytes: a training rank's peak; ratio = rehearsed / plan)")


if __name__ == "__main__":
    main()
