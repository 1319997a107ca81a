"""Datasets, prompts and the resumable loader."""

from __future__ import annotations

from rlfleet.config.schema import DataConfig
from rlfleet.data.arithmetic import arithmetic_splits
from rlfleet.data.loader import ResumableLoader
from rlfleet.data.prompts import build_prompts, render_prompt, response_target
from rlfleet.data.types import Example, Prompt

__all__ = [
    "Example",
    "Prompt",
    "ResumableLoader",
    "build_prompts",
    "load_task",
    "render_prompt",
    "response_target",
]


def load_task(data: DataConfig) -> tuple[list[Example], list[Example]]:
    """Train and validation examples of the configured dataset."""
    a = data.arithmetic
    return arithmetic_splits(
        num_train=a.num_train,
        num_val=a.num_val,
        seed=a.seed,
        min_ops=a.min_ops,
        max_ops=a.max_ops,
        max_operand=a.max_operand,
        operations=a.operations,
    )
