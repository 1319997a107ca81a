"""The embedded jobs (``rlfleet demo``): which recipes they run and where they build their models."""

from __future__ import annotations

DEMO_TASKS = {
    "arithmetic": ("sft-tiny-arithmetic-cpu", "grpo-tiny-arithmetic-cpu", "runs/demo"),
    "tools": ("sft-tiny-multiplication-tools-cpu", "grpo-tiny-multiplication-tools-cpu", "runs/tools"),
}
"""The embedded jobs (``rlfleet demo --task``): task -> (SFT recipe, GRPO recipe, output directory). Each
builds a tiny model there (``base_model``), warms it up with SFT (``sft_model``), then runs GRPO; the tiny
recipes name those directories as their ``policy.model_name``."""
DEMO_COMMANDS = {"arithmetic": "make train", "tools": "make train-tools"}

ARITHMETIC_PAIRS_DIR = "runs/demo/rm/pairs"
GENERATED_DATA = {ARITHMETIC_PAIRS_DIR: f"rlfleet data arithmetic-pairs {ARITHMETIC_PAIRS_DIR}"}
"""Data directories of the shipped recipes that no file ships: directory -> the command that writes its
files (``rm-tiny-arithmetic-cpu`` trains on the ``train.jsonl`` and ``val.jsonl`` of arithmetic pairs)."""
