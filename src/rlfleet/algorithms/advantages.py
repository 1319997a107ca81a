"""Group-relative advantages (GRPO).

Rewards arrive as a flat tensor of ``num_prompts * group_size`` values in which the samples of one prompt
are contiguous.
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, leave_one_out: bool, normalize: bool, eps: float = 1e-6
) -> torch.Tensor:
    """Advantage of each sample relative to the other samples of its prompt.

    Args:
        rewards: ``[P * G]`` rewards, groups contiguous.
        group_size: ``G``, samples per prompt.
        leave_one_out: Baseline is the mean of the *other* ``G - 1`` samples (else the group mean).
        normalize: Divide by the group's standard deviation (+ ``eps``) where it is non-zero.
        eps: Added to the standard deviation.

    Returns:
        ``[P * G]`` advantages; exactly 0 for every sample of a group whose rewards are all equal.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    if leave_one_out and group_size < 2:
        raise ValueError("a leave-one-out baseline needs at least 2 samples per prompt")
    grouped = rewards.reshape(-1, group_size)  # [P, G]
    if leave_one_out:
        baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    else:
        baseline = grouped.mean(dim=1, keepdim=True)
    adv = grouped - baseline
    std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(baseline)
    constant = std == 0  # [P, 1]
    if normalize:
        adv = torch.where(constant, adv, adv / (std + eps))
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.reshape(-1)


def zero_variance_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """Fraction of groups whose rewards are all equal (they carry no learning signal)."""
    grouped = rewards.reshape(-1, group_size)
    return float((grouped.max(dim=1).values == grouped.min(dim=1).values).float().mean())
