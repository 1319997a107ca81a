"""Importance-sampling corrections for the mismatch between the sampler and the trainer.

The generation engine (vLLM, or the HF sampler in another precision) and the trainer compute slightly
different probabilities for the same tokens, so the rollouts come from ``pi_gen``, not from the ``pi_prev``
the clipped objective assumes. The correction weights each token's loss by ``w = pi_prev / pi_gen =
exp(prev_logp - gen_logp)`` (detached), as NeMo RL does (``loss_fn.use_importance_sampling_correction``).
Unbounded, a few tokens with a large mismatch can dominate the update, hence the bounded variants that
``loss_fn.truncated_importance_sampling_type`` selects (NeMo RL's names):

- ``tis`` (truncated IS, Yao et al. 2025): ``clamp(w, floor, cap)``, the floor 0 unless set;
- ``icepop`` (MiniMax / Ling team 2025): tokens whose ``w`` is outside ``[low, high]`` get weight 0;
- ``seq-mask-tis``: sequences whose geometric-mean ratio ``exp(mean_t log w)`` is outside ``[low, high]``
  get weight 0; kept sequences keep their untruncated token weights.

All functions are pure; ``[B, T]`` tensors are aligned with ``mask`` (1.0 on response tokens).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

TruncationType = Literal["tis", "icepop", "seq-mask-tis"]
TRUNCATION_TYPES: tuple[TruncationType, ...] = ("tis", "icepop", "seq-mask-tis")


class ImportanceWeights(NamedTuple):
    """Weights to multiply the per-token loss with, and which tokens or sequences the bound changed.

    Attributes:
        weights: ``[B, T]`` (token level) or ``[B, 1]`` (one weight per sequence), detached.
        out_of_band: ``[B, T]`` float flags of the tokens truncated or masked, or ``[B]`` flags of the
            sequences masked (``seq-mask-tis``); None without a bound.
    """

    weights: torch.Tensor
    out_of_band: torch.Tensor | None


def _finite(values: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)


def token_importance_weights(prev_logprobs: torch.Tensor, gen_logprobs: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` ``exp(prev - gen)``, detached; non-finite values become 0 (the token is dropped)."""
    return _finite(torch.exp(prev_logprobs - gen_logprobs)).detach()


def sequence_importance_weights(
    prev_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``[B, 1]`` ``exp(sum_t (prev - gen))`` over the response tokens: the sequence's probability ratio
    (NeMo RL's correction with ``sequence_level_importance_ratios``), detached."""
    log_ratio = ((prev_logprobs - gen_logprobs) * mask).sum(dim=1, keepdim=True)
    return _finite(torch.exp(log_ratio)).detach()


def truncate_weights(weights: torch.Tensor, cap: float, floor: float = 0.0) -> ImportanceWeights:
    """TIS: ``clamp(w, floor, cap)`` (NeMo RL's lower bound defaults to 0, i.e. none); ``out_of_band``
    marks the weights the clamp changed."""
    changed = (weights > cap) | (weights < floor)
    return ImportanceWeights(weights.clamp(min=floor, max=cap), changed.to(weights.dtype))


def icepop_weights(weights: torch.Tensor, low: float, high: float) -> ImportanceWeights:
    """ICEPOP: weights outside ``[low, high]`` become 0, the others are kept unchanged."""
    keep = (weights >= low) & (weights <= high)
    return ImportanceWeights(torch.where(keep, weights, torch.zeros_like(weights)), (~keep).to(weights.dtype))


def sequence_mask_weights(
    weights: torch.Tensor,
    prev_logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    mask: torch.Tensor,
    low: float,
    high: float,
) -> ImportanceWeights:
    """Sequence masking: zero every weight of a sequence whose geometric-mean ratio
    ``exp(mean_t (prev - gen))`` is outside ``[low, high]``; ``out_of_band`` is ``[B]``."""
    log_ratio = _finite(prev_logprobs - gen_logprobs) * mask
    geo_mean = torch.exp(log_ratio.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0))  # [B]
    keep = (geo_mean >= low) & (geo_mean <= high)
    return ImportanceWeights(weights * keep.unsqueeze(1).to(weights.dtype), (~keep).to(weights.dtype))


def importance_weights(
    prev_logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    sequence_level: bool,
    truncation: TruncationType | None,
    ratio_max: float | None,
    ratio_min: float | None,
) -> ImportanceWeights:
    """The correction weights as configured: token (or sequence) ratios, then the chosen bound.

    Args:
        prev_logprobs: ``[B, T]`` the trainer's logprobs of the policy that sampled.
        gen_logprobs: ``[B, T]`` the generation engine's logprobs of the same tokens.
        mask: ``[B, T]`` response tokens.
        sequence_level: One weight per sequence (``exp(sum_t (prev - gen))``) instead of per token.
        truncation: None (untruncated), ``tis``, ``icepop`` or ``seq-mask-tis``.
        ratio_max: The cap (``tis``) or the band's upper end.
        ratio_min: The band's lower end (``icepop``, ``seq-mask-tis``) or the floor (``tis``; None = 0).
    """
    if sequence_level:
        weights = sequence_importance_weights(prev_logprobs, gen_logprobs, mask)
    else:
        weights = token_importance_weights(prev_logprobs, gen_logprobs)
    if truncation is None:
        return ImportanceWeights(weights, None)
    if ratio_max is None:
        raise ValueError(
            f"importance-sampling truncation {truncation!r} needs its bounds: the upper one (ratio_max)"
        )
    if ratio_min is not None and ratio_min > ratio_max:
        raise ValueError(f"importance-sampling bounds need min <= max, got min={ratio_min} > max={ratio_max}")
    if truncation == "tis":
        return truncate_weights(weights, ratio_max, 0.0 if ratio_min is None else ratio_min)
    if ratio_min is None:
        raise ValueError(
            f"importance-sampling truncation {truncation!r} needs its bounds: the lower one (ratio_min)"
        )
    if truncation == "icepop":
        return icepop_weights(weights, ratio_min, ratio_max)
    if truncation == "seq-mask-tis":
        if sequence_level:
            raise ValueError(
                "seq-mask-tis masks sequences of token-level weights; it cannot combine "
                "with sequence-level importance ratios"
            )
        return sequence_mask_weights(weights, prev_logprobs, gen_logprobs, mask, ratio_min, ratio_max)
    raise ValueError(
        f"unknown importance-sampling truncation {truncation!r}; choose one of {TRUNCATION_TYPES}"
    )
