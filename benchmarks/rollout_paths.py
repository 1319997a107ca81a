"""The one rollout path against the single-turn path it replaced, side by side in one run, the same seeds.

rlfleet once had two rollout paths: single-turn rows were sampled with ``backend.generate`` and scored by the
reward function in a pool of worker processes; multi-turn rows ran episodes with environments. Now a
single-turn row is a one-turn episode of the ``math`` environment (``EpisodeRunner``), as NeMo RL runs math.
This script keeps the old single-turn collector (``SingleTurnCollector`` below, the code that was removed) to
measure what the one path costs, on one trainer:

* **collect** (same seeds): for each step index, both collectors draw the same prompts (the loader is rewound)
  with the same seed; their rollouts must be token for token and reward for reward the same; the table gives
  seconds per collection and generated tokens per second of each path.
* **step**: whole GRPO steps (collect, advantages, logprobs, training, refit), the collector alternating
  between the paths step by step (ABAB...), the first two steps dropped as warm-up; seconds per step and
  tokens per second of each path.

The default job's GRPO stage (``make train`` builds ``runs/demo/sft_model``; without it the tiny base model
is built) and the SmolLM2 arithmetic recipe (vLLM where installed):

    .venv/bin/python benchmarks/rollout_paths.py --steps 6
    .venv/bin/python benchmarks/rollout_paths.py --recipe grpo-smollm2-135m-arithmetic-cpu --model '' \
        --steps 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: benchmarks/ importable

from benchmarks.scratch import scratch_dir

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.config import load_recipe, quote_override_value, resolve_recipe_path
from rlfleet.demo import ensure_tiny_model
from rlfleet.pools import ProcessWorkerPool
from rlfleet.rollouts.collect import Collected
from rlfleet.rollouts.dynamic_sampling import SampledGroups
from rlfleet.rollouts.rollout import Rollout
from rlfleet.runtime.loop import closing_run

DEFAULT_RECIPE = "grpo-tiny-arithmetic-cpu"


class SingleTurnCollector:
    """The removed single-turn path: ``backend.generate`` of ``G`` samples per prompt, then the reward
    function on each ``(prompt, response, gold)`` in the worker pool (no dynamic sampling: one round)."""

    def __init__(self, trainer: GRPO, pool: ProcessWorkerPool) -> None:
        self.trainer, self.pool = trainer, pool

    def __call__(self, step: int) -> Collected:
        trainer = self.trainer
        settings = trainer.settings
        prompts = trainer.ctx.loader.next_batch()
        repeated = [p for p in prompts for _ in range(settings.group_size)]
        seed = trainer._round_seed(step, 0)
        start = time.perf_counter()
        results = trainer.backend.generate([p.token_ids for p in repeated], settings.sampling, seed)
        generation = time.perf_counter() - start
        items = [(p.text, r.text, p.example.gold) for p, r in zip(repeated, results, strict=True)]
        scored = self.pool.score(items)
        reward = time.perf_counter() - start - generation
        rollouts = [Rollout(p, r, x) for p, r, x in zip(repeated, results, scored.rewards, strict=True)]
        groups = SampledGroups.one_round(rollouts, settings.group_size)
        seconds = {"generation": generation, "env": reward}
        return Collected(groups, rollouts, scored.num_timeouts, scored.num_errors, seconds)


def build_trainer(recipe: str, model: str, steps: int, extra: Sequence[str]) -> GRPO:
    run_dir = scratch_dir("rlfleet-paths-")
    overrides = [
        f"checkpointing.checkpoint_dir={quote_override_value(str(run_dir / 'ckpt'))}",
        f"logger.log_dir={quote_override_value(str(run_dir / 'logs'))}",
        f"grpo.max_num_steps={steps}",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "grpo.use_dynamic_sampling=false",
        "checkpointing.enabled=false",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
    ]
    if model:
        overrides.insert(0, f"policy.model_name={quote_override_value(model)}")
    cfg = load_recipe(resolve_recipe_path(recipe), [*overrides, *extra])
    return GRPO(cfg)


def generated_tokens(collected: Collected) -> int:
    return sum(r.num_response_tokens for r in collected.drawn)


def same_rollouts(a: Collected, b: Collected) -> bool:
    def key(r: Rollout) -> tuple[Any, ...]:
        return r.result.token_ids, r.reward

    return [key(r) for r in a.drawn] == [key(r) for r in b.drawn]


Paths = dict[str, Callable[[int], Collected]]
Timings = dict[str, list[tuple[float, int]]]


def collect_table(trainer: GRPO, paths: Paths, steps: int) -> Timings:
    """Per path: ``(seconds, generated tokens)`` of each step index's collection (same prompts and seed)."""
    loader = trainer.ctx.loader
    out: Timings = {name: [] for name in paths}
    for step in range(steps):
        state = loader.state_dict()
        order = list(paths) if step % 2 == 0 else list(reversed(paths))
        collected = {}
        for name in order:
            loader.load_state_dict(state)
            start = time.perf_counter()
            collected[name] = paths[name](step)
            out[name].append((time.perf_counter() - start, generated_tokens(collected[name])))
        first, *others = collected.values()
        if not all(same_rollouts(first, other) for other in others):
            raise SystemExit(f"step {step}: the paths sampled or scored differently; the comparison is void")
    return out


def step_table(trainer: GRPO, paths: Paths, steps: int) -> Timings:
    """Per path: ``(seconds, tokens trained)`` of whole GRPO steps, the collector alternating step by step."""
    out: Timings = {name: [] for name in paths}
    names = list(paths)
    for i in range(steps * len(names)):
        name = names[i % len(names)]
        trainer.collect = paths[name]
        start = time.perf_counter()
        metrics = trainer.step()
        trainer.ctx.step += 1
        seconds = time.perf_counter() - start
        if i >= len(names):  # the first step of each path is warm-up
            out[name].append((seconds, int(metrics["train/num_tokens"])))
    return out


def print_table(title: str, rows: Timings, unit: str) -> None:
    print(f"\n{title}")
    print(f"{'path':<38} {'s/' + unit:>8} {'tokens/s':>9} {'time ratio':>10}")
    base = None
    for name, samples in rows.items():
        seconds = statistics.median(s for s, _ in samples)  # the median: one slow outlier is noise
        rate = sum(t for _, t in samples) / sum(s for s, _ in samples)
        base = base if base is not None else seconds
        print(f"{name:<38} {seconds:>8.3f} {rate:>9.0f} {seconds / base:>10.3f}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument(
        "--model",
        default="runs/demo/sft_model",
        help="model dir (make train makes it; missing: the tiny base model is built); '' keeps the recipe's",
    )
    parser.add_argument("--steps", type=int, default=6, help="measured steps per path and table")
    parser.add_argument("--quick", action="store_true", help="2 steps of a tiny case (a smoke test)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 2
        args.overrides = [
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=4",
            "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=8",
            "policy.logprob_batch_size=8",
            "policy.generation.max_new_tokens=8",
            *args.overrides,
        ]
    return args


def resolve_model(args: argparse.Namespace) -> str:
    if not args.model or Path(args.model).is_dir() or args.recipe != DEFAULT_RECIPE:
        return args.model
    base = scratch_dir("rlfleet-paths-model-") / "base_model"
    cfg = load_recipe(resolve_recipe_path(DEFAULT_RECIPE), [])
    print(f"{args.model} not found: building the tiny base model in {base}")
    return str(ensure_tiny_model(base, cfg, seed=0))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    trainer = build_trainer(args.recipe, resolve_model(args), 10**6, args.overrides)
    math = trainer.cfg.env.math
    try:
        with ProcessWorkerPool(math.reward_fn, math.num_workers, math.timeout_s) as pool:
            pool.wait_ready()
            paths = {
                "single-turn (generate + reward pool)": SingleTurnCollector(trainer, pool),
                "one path (one-turn math episode)": trainer.collect,
            }
            print(f"{args.recipe}, model {trainer.cfg.policy.model_name}")
            collect = collect_table(trainer, paths, args.steps + 1)
            warm = {name: rows[1:] for name, rows in collect.items()}  # the first index is warm-up
            print_table("collect, same prompts and seeds", warm, "collect")
            print_table("whole GRPO steps, paths alternating", step_table(trainer, paths, args.steps), "step")
    finally:
        with closing_run(trainer.ctx):  # stops the engines and environment workers
            pass


if __name__ == "__main__":
    main()
