"""The learning-rate schedule: linear warm-up, then constant, linear or cosine decay.

One pure function of the optimizer step, so the schedule is the same in every worker and after a resume
(the scheduler's state is its step count). It equals what NeMo RL recipes build from torch's schedulers:
``SequentialLR([LinearLR(start_factor, 1.0, warmup), <decay>], milestones=[warmup])`` with ``<decay>``
``ConstantLR(1.0)``, ``LinearLR(1.0, min_factor, decay_steps)`` or
``CosineAnnealingLR(decay_steps, eta_min=min_factor * lr)`` (``tests/unit/test_lr_schedule.py`` holds it to
torch's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Decay = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True)
class LrSchedule:
    """``policy.scheduler``: warm-up over ``warmup_steps`` optimizer steps from ``warmup_start_factor`` x
    lr, then ``decay`` over ``decay_steps`` steps down to ``min_factor`` x lr, which it keeps."""

    warmup_steps: int = 0
    warmup_start_factor: float = 1.0
    decay: Decay = "constant"
    decay_steps: int | None = None
    min_factor: float = 0.0

    def __post_init__(self) -> None:
        if self.decay != "constant" and (self.decay_steps is None or self.decay_steps < 1):
            raise ValueError(f"a {self.decay} decay needs decay_steps >= 1, got {self.decay_steps}")


def lr_factor(step: int, schedule: LrSchedule) -> float:
    """The multiplier of the base lr at optimizer step ``step`` (0-based: the step about to be taken)."""
    warmup = schedule.warmup_steps
    if step < warmup:
        start = schedule.warmup_start_factor
        return start + (1.0 - start) * step / warmup
    if schedule.decay == "constant":
        return 1.0
    assert schedule.decay_steps is not None  # __post_init__
    progress = min(step - warmup, schedule.decay_steps) / schedule.decay_steps
    low = schedule.min_factor
    if schedule.decay == "linear":
        return 1.0 + (low - 1.0) * progress
    return low + (1.0 - low) * (1.0 + math.cos(math.pi * progress)) / 2.0
