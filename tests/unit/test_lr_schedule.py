"""The lr schedule (``policy.scheduler``) equals the torch schedulers NeMo RL recipes chain for it.

NeMo RL's recipes spell warm-up then constant as ``SequentialLR([LinearLR(0.1, 1.0, 50), ConstantLR(1.0)],
milestones=[50])`` (``examples/configs/grpo_math_1B.yaml``); a decay replaces the second scheduler by
``LinearLR`` or ``CosineAnnealingLR``. ``lr_factor`` must trace the same lr, step for step.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from pydantic import ValidationError

from rlfleet.config.schema import SchedulerConfig
from rlfleet.policy.schedule import LrSchedule, lr_factor

LR = 2e-5


def torch_lrs(schedule: LrSchedule, steps: int) -> list[float]:
    """The lr of each of ``steps`` optimizer steps under torch's chained schedulers."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    if schedule.decay == "constant":
        second: torch.optim.lr_scheduler.LRScheduler = torch.optim.lr_scheduler.ConstantLR(
            opt, factor=1.0, total_iters=1
        )
    elif schedule.decay == "linear":
        second = torch.optim.lr_scheduler.LinearLR(
            opt,
            start_factor=1.0,
            end_factor=max(schedule.min_factor, 1e-12),
            total_iters=schedule.decay_steps,
        )
    else:
        assert schedule.decay_steps is not None
        second = torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, T_max=schedule.decay_steps, eta_min=schedule.min_factor * LR
        )
    chained: torch.optim.lr_scheduler.LRScheduler = second
    if schedule.warmup_steps:
        first = torch.optim.lr_scheduler.LinearLR(
            opt, start_factor=schedule.warmup_start_factor, total_iters=schedule.warmup_steps
        )
        chained = torch.optim.lr_scheduler.SequentialLR(
            opt, [first, second], milestones=[schedule.warmup_steps]
        )
    return trace(opt, chained, steps)


def trace(
    opt: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int
) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return lrs


def ours(schedule: LrSchedule, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    return trace(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, schedule)), steps)


@pytest.mark.parametrize(
    "schedule",
    [
        LrSchedule(warmup_steps=50, warmup_start_factor=0.1),  # NeMo RL grpo_math_1B
        LrSchedule(warmup_steps=5, warmup_start_factor=0.1, decay="linear", decay_steps=20, min_factor=0.1),
        LrSchedule(warmup_steps=0, decay="linear", decay_steps=30, min_factor=0.25),
        LrSchedule(warmup_steps=4, warmup_start_factor=0.5, decay="cosine", decay_steps=16, min_factor=0.0),
        LrSchedule(warmup_steps=0, decay="cosine", decay_steps=10, min_factor=0.2),
    ],
    ids=["warmup-constant", "warmup-linear", "linear", "warmup-cosine", "cosine-floor"],
)
def test_lr_matches_torch_chained_schedulers(schedule: LrSchedule) -> None:
    # to the end of the decay (torch's cosine rises again after T_max; ours keeps the floor, tested below)
    steps = schedule.warmup_steps + (schedule.decay_steps or 10) + 1
    assert ours(schedule, steps) == pytest.approx(torch_lrs(schedule, steps), rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("decay", ["linear", "cosine"])
def test_decay_reaches_and_keeps_the_floor(decay: str) -> None:
    schedule = LrSchedule(warmup_steps=2, decay=decay, decay_steps=4, min_factor=0.1)  # type: ignore[arg-type]
    factors = [lr_factor(s, schedule) for s in range(10)]
    assert factors[:2] == pytest.approx([1.0, 1.0])  # start factor 1.0: no warm-up ramp
    assert factors[2] == 1.0 and factors[6:] == pytest.approx([0.1] * 4)
    assert all(a >= b for a, b in itertools.pairwise(factors))


def test_a_decay_needs_its_length() -> None:
    with pytest.raises(ValidationError, match="decay_steps"):
        SchedulerConfig(decay="cosine")
    with pytest.raises(ValueError, match="decay_steps"):
        LrSchedule(decay="linear")
    assert SchedulerConfig(decay="cosine", decay_steps=30).decay_steps == 30


def test_recipe_keys_reach_the_worker_schedule() -> None:
    from rlfleet.config.loader import load_recipe, resolve_recipe_path
    from rlfleet.runtime.components import optimizer_settings

    cfg = load_recipe(
        resolve_recipe_path("grpo-smollm2-135m-arithmetic-cpu"),
        [
            "policy.scheduler.warmup_steps=3",
            "policy.scheduler.warmup_start_factor=0.2",
            "policy.scheduler.decay=cosine",
            "policy.scheduler.decay_steps=27",
            "policy.scheduler.min_lr_factor=0.1",
        ],
    )
    assert optimizer_settings(cfg).schedule == LrSchedule(
        warmup_steps=3, warmup_start_factor=0.2, decay="cosine", decay_steps=27, min_factor=0.1
    )
