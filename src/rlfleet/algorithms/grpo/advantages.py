"""Group-relative advantages (GRPO).

Rewards arrive as a flat tensor of ``num_prompts * group_size`` values in which the samples of one prompt
are contiguous.

With ``grpo.use_leave_one_out_baseline`` and ``grpo.normalize_rewards`` (NeMo RL's defaults), sample ``i``'s
advantage is ``(r_i - mean of the others) / (std of the others + eps)``, the std taken over the same
``G - 1`` samples as the baseline (unbiased), as NeMo RL's ``calculate_baseline_and_std_per_prompt`` does.
``grpo.advantage_std=group`` instead divides every sample of a group by the whole group's std, one scale
per group (the DeepSeekMath paper's normalisation): with the leave-one-out std, a lone success among
failures has peers of zero spread and keeps its raw advantage while its peers are scaled up, so the
group's advantages no longer sum to zero; the group std keeps that zero sum.
"""

from __future__ import annotations

from typing import Literal

import torch

from rlfleet.rollouts.groups import by_group, flat_groups

AdvantageStd = Literal["baseline_samples", "group"]


def leave_one_out_std(grouped: torch.Tensor) -> torch.Tensor:
    """``[P, G]`` unbiased std of the ``G - 1`` rewards other than each sample; 0 where they are all equal
    or fewer than two (exact zeros, never a rounding residue that would blow up a division)."""
    size = grouped.shape[1]
    if size < 3:
        return torch.zeros_like(grouped)
    others = ~torch.eye(size, dtype=torch.bool, device=grouped.device)  # [G, G]: row i = samples j != i
    values = grouped.unsqueeze(1).expand(-1, size, -1)  # [P, G, G]
    mean = (values * others).sum(dim=2, keepdim=True) / (size - 1)
    var = (((values - mean) * others) ** 2).sum(dim=2) / (size - 2)
    high = values.masked_fill(~others, float("-inf")).amax(dim=2)
    low = values.masked_fill(~others, float("inf")).amin(dim=2)
    return torch.where(high == low, torch.zeros_like(var), var.sqrt())


def baseline_and_std(
    rewards: torch.Tensor,
    group_size: int,
    *,
    leave_one_out: bool,
    std_over: AdvantageStd = "baseline_samples",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([P * G], [P * G])``: each sample's baseline and the std its advantage is divided by.

    Args:
        rewards: ``[P * G]`` rewards, groups contiguous.
        group_size: ``G``, samples per prompt.
        leave_one_out: Baseline is the mean of the *other* ``G - 1`` samples (else the group mean).
        std_over: ``baseline_samples``: the unbiased std of the samples the baseline averages (the other
            ``G - 1`` with a leave-one-out baseline; NeMo RL); ``group``: the whole group's, for every sample.
    """
    if leave_one_out and group_size < 2:
        raise ValueError("a leave-one-out baseline needs at least 2 samples per prompt")
    grouped = by_group(rewards, group_size)
    if leave_one_out:
        baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    else:
        baseline = grouped.mean(dim=1, keepdim=True).expand_as(grouped)
    if leave_one_out and std_over == "baseline_samples":
        std = leave_one_out_std(grouped)
    elif group_size > 1:
        constant = flat_groups(rewards, group_size).unsqueeze(1)
        std = torch.where(constant, 0.0, grouped.std(dim=1, keepdim=True)).expand_as(grouped)
    else:
        std = torch.zeros_like(grouped)
    return baseline.reshape(-1), std.reshape(-1)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    leave_one_out: bool,
    normalize: bool,
    std_over: AdvantageStd = "baseline_samples",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantage of each sample relative to the other samples of its prompt.

    Args:
        rewards: ``[P * G]`` rewards, groups contiguous.
        group_size: ``G``, samples per prompt.
        leave_one_out: Baseline is the mean of the *other* ``G - 1`` samples (else the group mean).
        normalize: Divide by the std (+ ``eps``) where it is non-zero (see :func:`baseline_and_std`).
        std_over: Which samples' std (see :func:`baseline_and_std`).
        eps: Added to the standard deviation.

    Returns:
        ``[P * G]`` advantages; exactly 0 for every sample of a group whose rewards are all equal.
    """
    baseline, std = baseline_and_std(rewards, group_size, leave_one_out=leave_one_out, std_over=std_over)
    adv = rewards - baseline
    if normalize:
        adv = torch.where(std > 0, adv / (std + eps), adv)
    flat = flat_groups(rewards, group_size).repeat_interleave(group_size)
    return torch.where(flat, torch.zeros_like(adv), adv)


def zero_variance_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """Fraction of groups whose rewards are all equal (they carry no learning signal)."""
    return float(flat_groups(rewards, group_size).float().mean())


def signal_metrics(correct: torch.Tensor, advantages: torch.Tensor, group_size: int) -> dict[str, float]:
    """Where a step's learning signal comes from, by the verifier's verdicts ``correct`` ``[P * G]`` (bool)
    and the advantages trained on ``[P * G]``:

    - ``correctness_signal_groups``: the share of groups holding both a right and a wrong sample, the only
      groups whose advantages say which answers are right;
    - ``advantage_share_without_correct``: the share of the step's total ``|advantage|`` that comes from
      groups without a right sample, where only reward shaping (an overlong penalty) tells samples apart.
      Normalised by a group's std, a length difference of a few tokens there weighs as much as a right
      answer elsewhere.
    """
    right = by_group(correct.float(), group_size)
    mixed = (right.amax(dim=1) > 0) & (right.amin(dim=1) == 0)  # [P]
    weight = by_group(advantages.abs(), group_size).sum(dim=1)  # [P]
    total = float(weight.sum())
    without = float(weight[right.amax(dim=1) == 0].sum())
    return {
        "correctness_signal_groups": float(mixed.float().mean()),
        "advantage_share_without_correct": without / total if total > 0 else 0.0,
    }
