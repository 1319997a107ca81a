"""The embedded jobs: build a tiny model (or take the pretrained one the recipe names: Gemma 3 270M), SFT
warm start, then GRPO, all on CPU and offline.

Every stage is resumable: rerunning skips what is finished and continues what was interrupted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from rlfleet.algorithms.grpo.loop import grpo_train
from rlfleet.algorithms.sft.loop import SFT, sft_train
from rlfleet.checkpoint import CheckpointManager, export_hf
from rlfleet.checkpoint.space import ensure_pipeline_disk, export_bytes, run_steps
from rlfleet.config import (
    DEMO_TASKS,
    PRETRAINED_DEMO_TASKS,
    MasterConfig,
    load_recipe,
    parse_override,
    quote_override_value,
    resolve_recipe_path,
)
from rlfleet.data import load_prompt_template, load_task, render_prompt, resolve_system_prompt
from rlfleet.logging import read_metrics
from rlfleet.logging.capture import terminal
from rlfleet.models.tiny import TinyModelSpec, create_tiny_model, train_tokenizer

log = logging.getLogger("rlfleet")

SFT_RECIPE, GRPO_RECIPE, _ = DEMO_TASKS["arithmetic"]


def tokenizer_corpus(cfg: MasterConfig) -> list[str]:
    """Task text plus the chat-template scaffolding, so the tokenizer learns both."""
    train, _ = load_task(cfg.data)
    scaffold = train_tokenizer(["user assistant system"], 300)  # only to render the chat format
    system, template = resolve_system_prompt(cfg.data), load_prompt_template(cfg.data)
    return [render_prompt(scaffold, ex.question, system, template) + ex.answer for ex in train]


def ensure_tiny_model(out_dir: Path, cfg: MasterConfig, seed: int) -> Path:
    if (out_dir / "config.json").is_file():
        return out_dir
    log.info("building the tiny base model in %s", out_dir)
    return create_tiny_model(out_dir, tokenizer_corpus(cfg), TinyModelSpec(), seed)


def stage_overrides(out: Path, stage: str, model: Path | str) -> list[str]:
    return [
        f"policy.model_name={quote_override_value(str(model))}",
        f"checkpointing.checkpoint_dir={quote_override_value(str(out / stage / 'checkpoints'))}",
        f"logger.log_dir={quote_override_value(str(out / stage / 'logs'))}",
    ]


def val_accuracy_curve(log_dir: Path) -> list[tuple[int, float]]:
    return [
        (r["step"], r["val/accuracy"]) for r in read_metrics(log_dir) if r.get("val/accuracy") is not None
    ]


def stage_accuracies(
    sft_curve: Sequence[tuple[int, float]], grpo_curve: Sequence[tuple[int, float]]
) -> tuple[float | None, float | None, float | None]:
    """``(before SFT, after SFT, after GRPO)`` from the stages' validation curves: the SFT stage's step-0
    validation; the GRPO stage's step-0 one, else the SFT stage's last (the same model); the GRPO stage's
    last after step 0. None where no validation measured it."""
    before_sft = sft_curve[0][1] if sft_curve and sft_curve[0][0] == 0 else None
    if grpo_curve and grpo_curve[0][0] == 0:
        after_sft: float | None = grpo_curve[0][1]
    else:
        after_sft = sft_curve[-1][1] if sft_curve and sft_curve[-1][0] > 0 else None
    trained = [acc for step, acc in grpo_curve if step > 0]
    return before_sft, after_sft, trained[-1] if trained else None


def accuracy_line(before_sft: float | None, after_sft: float | None, after_grpo: float | None) -> str:
    """``"0.5% before SFT -> 4.5% after SFT -> 3.5% after GRPO (-1.0 points)"``, each part as measured."""
    parts = [
        f"{acc:.1%} {when}"
        for acc, when in ((before_sft, "before SFT"), (after_sft, "after SFT"), (after_grpo, "after GRPO"))
        if acc is not None
    ]
    gain = (
        f" ({(after_grpo - after_sft) * 100:+.1f} points)"
        if after_sft is not None and after_grpo is not None
        else ""
    )
    return " -> ".join(parts) + gain if parts else "not validated (val_period=0 and no validation at the end)"


def sft_section(overrides: Sequence[str]) -> list[str]:
    """The overrides of the ``sft`` section, which only the SFT stage reads (the GRPO recipe carries it)."""
    return [o for o in overrides if parse_override(o).key[0] == SFT.algorithm]


def run_demo(
    out: Path, overrides: Sequence[str] = (), sft_overrides: Sequence[str] = (), task: str = "arithmetic"
) -> dict[str, float]:
    """Runs the three stages of ``task`` (``rlfleet.config.DEMO_TASKS``) under ``out``; returns the
    before/after validation accuracies. A pretrained task (``PRETRAINED_DEMO_TASKS``) builds no model: its SFT
    recipe's own model is the base.

    ``overrides`` go to the GRPO stage; those of the ``sft`` section (``sft.max_num_steps=...``) go to the
    SFT stage as well, after ``sft_overrides``.
    """
    out = out.resolve()
    sft_recipe, grpo_recipe, _ = DEMO_TASKS[task]
    sft_overrides = [*sft_overrides, *sft_section(overrides)]
    if task in PRETRAINED_DEMO_TASKS:
        base = load_recipe(resolve_recipe_path(sft_recipe), sft_overrides).policy.model_name
    else:
        cfg = load_recipe(
            resolve_recipe_path(sft_recipe), [*stage_overrides(out, "sft", out), *sft_overrides]
        )
        base = str(ensure_tiny_model(out / "base_model", cfg, seed=cfg.sft.seed))
    sft_cfg = load_recipe(
        resolve_recipe_path(sft_recipe), [*stage_overrides(out, "sft", base), *sft_overrides]
    )
    sft_model = out / "sft_model"
    grpo_cfg = load_recipe(
        resolve_recipe_path(grpo_recipe), [*stage_overrides(out, "grpo", sft_model), *overrides]
    )
    exported = (sft_model / "config.json").is_file()
    ensure_pipeline_disk(  # before SFT: its checkpoints and model stay on disk while GRPO saves its own
        [(sft_cfg, run_steps(sft_cfg, "sft")), (grpo_cfg, run_steps(grpo_cfg, "grpo"))],
        [0 if exported else export_bytes(sft_cfg)],
        fix=f"--out <a directory on a disk with room> (now {out}), or free space",
    )
    print(f"== stage 1/2: SFT warm start of {base}", flush=True, file=terminal())
    sft_train(sft_cfg, release=True)  # its worker's memory freed before GRPO starts in this process
    if not exported:
        latest = CheckpointManager(Path(sft_cfg.checkpointing.checkpoint_dir), None, True, None).latest()
        if latest is None:
            raise RuntimeError(f"SFT wrote no checkpoint under {sft_cfg.checkpointing.checkpoint_dir}")
        export_hf(latest, sft_model)
    print(f"== stage 2/2: GRPO from {sft_model}", flush=True, file=terminal())
    grpo_train(grpo_cfg)
    accuracies = stage_accuracies(
        val_accuracy_curve(Path(sft_cfg.logger.log_dir)), val_accuracy_curve(Path(grpo_cfg.logger.log_dir))
    )
    log_dir = Path(grpo_cfg.logger.log_dir)
    from rlfleet.logging.plot import plot_stages  # matplotlib: loaded once the run is over

    curve_png = plot_stages(
        [("SFT", Path(sft_cfg.logger.log_dir)), ("GRPO", log_dir)],
        out / "plot.png",
        f"{base if task in PRETRAINED_DEMO_TASKS else 'tiny model'}: SFT, then GRPO ({task})",
    )
    print(
        "\n== done\n"
        f"validation accuracy (greedy, {grpo_cfg.grpo.max_val_samples} held-out problems): "
        f"{accuracy_line(*accuracies)}\n"
        f"metrics:     {log_dir / 'metrics.jsonl'}\n"
        f"plot:        {log_dir / 'plot.png'}\n"
        f"curve:       {curve_png} (validation accuracy through SFT and GRPO)\n"
        f"samples:     {log_dir / 'samples.jsonl'}\n"
        f"checkpoints: {grpo_cfg.checkpointing.checkpoint_dir}\n"
        f"TensorBoard: tensorboard --logdir {log_dir}",
        flush=True,
        file=terminal(),
    )
    _, after_sft, after_grpo = accuracies
    nan = float("nan")
    return {
        "val_accuracy_before": nan if after_sft is None else after_sft,
        "val_accuracy_after": nan if after_grpo is None else after_grpo,
    }
