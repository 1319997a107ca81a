"""Loss maths: masked reductions, the k3 KL estimator, and the clipped policy-gradient loss.

All tensors are ``[B, T]`` per-token values aligned with ``mask`` (1.0 on response tokens, 0.0 elsewhere)
unless stated. Following NeMo RL, for token ``t`` of response ``i``::

    r      = exp(logp - prev_logp)
    L_clip = max(-A * r, -A * clamp(r, 1 - eps_low, 1 + eps_high))      (optionally dual-clipped)
    x      = clamp(ref_logp - logp, -kl_in, kl_in)
    kl     = clamp(exp(x) - 1 - x, -kl_out, kl_out)                      (k3 estimator of KL(pi || ref))
    L      = L_clip + beta * kl

and the batch loss is either a token-level mean over every valid token of the *global* batch or a mean of
per-sequence means. ``aggregate`` takes the global normalisers so that micro-batching with gradient
accumulation (and, later, data parallelism) gives the same gradient as one big batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1; 0 when the mask is empty."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def kl_k3(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    input_clamp: float | None = 20.0,
    output_clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): ``exp(x) - 1 - x``, ``x = ref_logp - logp``; ``[B, T]``."""
    x = ref_logprobs - logprobs
    if input_clamp is not None:
        x = x.clamp(-input_clamp, input_clamp)
    kl = torch.exp(x) - 1.0 - x
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


def clipped_pg_loss(
    logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss (PPO/GRPO) and the probability ratio.

    Args:
        logprobs: ``[B, T]`` current-policy logprobs (carry gradient).
        prev_logprobs: ``[B, T]`` logprobs of the policy that produced the data (no gradient).
        advantages: ``[B, 1]`` or ``[B, T]`` advantages.
        eps_low: Ratio clipped below at ``1 - eps_low``.
        eps_high: Ratio clipped above at ``1 + eps_high``.
        dual_clip_c: When set (> 1), negative-advantage losses are capped at ``-c * A`` (dual clip).

    Returns:
        ``(loss [B, T], ratio [B, T])``.
    """
    ratio = torch.exp(logprobs - prev_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        capped = torch.minimum(loss, -advantages * dual_clip_c)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, ratio


@dataclass(frozen=True)
class Normalizer:
    """Global counts an optimizer step's loss is divided by (summed over micro-batches and ranks)."""

    num_tokens: float
    num_sequences: float


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, norm: Normalizer, token_level: bool
) -> torch.Tensor:
    """This micro-batch's share of the global loss.

    Token level: ``sum(per_token * mask) / norm.num_tokens``. Sequence level: the sum of per-sequence means
    divided by ``norm.num_sequences``. Summed over the micro-batches of a step, either equals the loss of the
    whole batch computed at once.
    """
    if token_level:
        return masked_sum(per_token, mask) / max(norm.num_tokens, 1.0)
    per_seq = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return per_seq.sum() / max(norm.num_sequences, 1.0)
