"""DAPO's dynamic sampling: keep drawing prompts until the step has enough groups that carry a signal.

A group whose ``G`` rewards are all equal has zero advantage for every sample: it adds compute and no
gradient. Dynamic sampling (Yu et al. 2025, NeMo RL's ``grpo.use_dynamic_sampling``) drops those groups
and draws another round of prompts until ``num_prompts_per_step`` informative groups are collected, for at
most ``dynamic_sampling_max_gen_batches`` rounds. Where NeMo RL raises when the bound is hit, rlfleet trains
on the groups it has and reports ``filled = False``; a step with none skips its update.

Groups are judged on the *unshaped* rewards (as NeMo RL does), so a length penalty alone does not make an
all-correct group informative. Surplus informative groups of the last round are discarded (not carried
into the next step), so every step's prompts are exactly the loader batches it consumed and resume stays
exact. Each round takes one loader batch of ``int(num_prompts_per_step * batch_multiplier)`` prompts; a
step may use several, so ``grpo.max_num_epochs`` bounds the number of steps (at most one epoch's batches
per epoch) rather than the passes over the data, which the loader continues into the next epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from rlfleet.rollouts.groups import flat_groups

T = TypeVar("T")


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[P]`` bool: the groups (``group_size`` contiguous rewards each) whose rewards are not all equal."""
    return ~flat_groups(rewards, group_size)


@dataclass(frozen=True)
class SampledGroups(Generic[T]):
    """The groups a step trains on and how they were collected.

    Attributes:
        samples: ``groups_kept * group_size`` samples, groups contiguous.
        rounds: Generation rounds used (1 .. max_rounds).
        prompts_drawn: Prompts generated for, over every round.
        groups_kept: Groups in ``samples`` (<= the target).
        groups_discarded: Informative groups beyond the target, dropped.
        filled: Whether the target was reached.
    """

    samples: list[T]
    rounds: int
    prompts_drawn: int
    groups_kept: int
    groups_discarded: int
    filled: bool

    @classmethod
    def one_round(cls, samples: list[T], group_size: int) -> SampledGroups[T]:
        """Every group of one round kept, informative or not (plain GRPO, no dynamic sampling)."""
        groups = len(samples) // group_size
        return cls(
            samples, rounds=1, prompts_drawn=groups, groups_kept=groups, groups_discarded=0, filled=True
        )

    def metrics(self, prefix: str = "train/dynamic_sampling_") -> dict[str, float]:
        return {
            f"{prefix}rounds": self.rounds,
            f"{prefix}prompts_drawn": self.prompts_drawn,
            f"{prefix}groups_kept": self.groups_kept,
            f"{prefix}groups_discarded": self.groups_discarded,
            f"{prefix}filled": float(self.filled),
        }


def collect_informative_groups(
    draw: Callable[[int], Sequence[T]],
    reward_of: Callable[[T], float],
    *,
    group_size: int,
    target_groups: int,
    max_rounds: int,
) -> SampledGroups[T]:
    """Calls ``draw(round)`` (scored samples, groups contiguous) until ``target_groups`` informative groups
    are collected or ``max_rounds`` rounds were used; keeps the first ``target_groups`` of them."""
    if max_rounds < 1 or target_groups < 1:
        raise ValueError(f"need max_rounds >= 1 and target_groups >= 1, got {max_rounds}, {target_groups}")
    kept: list[list[T]] = []
    found = prompts = rounds = 0
    while rounds < max_rounds and found < target_groups:
        samples = list(draw(rounds))
        rounds += 1
        if len(samples) % group_size:
            raise ValueError(f"a round returned {len(samples)} samples, not whole groups of {group_size}")
        prompts += len(samples) // group_size
        rewards = torch.tensor([reward_of(s) for s in samples], dtype=torch.float64)
        for g in torch.nonzero(informative_groups(rewards, group_size)).flatten().tolist():
            kept.append(samples[g * group_size : (g + 1) * group_size])
            found += 1
    chosen = kept[:target_groups]
    return SampledGroups(
        samples=[s for group in chosen for s in group],
        rounds=rounds,
        prompts_drawn=prompts,
        groups_kept=len(chosen),
        groups_discarded=found - len(chosen),
        filled=found >= target_groups,
    )


def trainable_rows(num_rows: int, global_batch_size: int, dp_size: int) -> tuple[int, int]:
    """``(rows to train on, global batch size)`` for a step that has ``num_rows`` rows.

    Whole global batches when there are enough rows (the rest is dropped); else one optimizer step on all
    the rows that split evenly over the ``dp_size`` data-parallel ranks. ``(0, 0)``: nothing to train on.
    """
    if num_rows >= global_batch_size:
        return num_rows // global_batch_size * global_batch_size, global_batch_size
    rows = num_rows - num_rows % dp_size
    return rows, rows
