"""Groups: the ``G`` contiguous rollouts of one prompt, the unit GRPO's advantages and DAPO's dynamic sampling
read."""

from __future__ import annotations

import torch


def by_group(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[P, G]`` the ``[N]`` rewards by group.

    Raises:
        ValueError: ``N`` is not a multiple of ``group_size``.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    return rewards.reshape(-1, group_size)  # [P, G]


def flat_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[P]`` bool: the groups whose ``G`` rewards are all equal (zero advantage: no learning signal)."""
    grouped = by_group(rewards, group_size)
    return grouped.amax(dim=1) == grouped.amin(dim=1)
