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
