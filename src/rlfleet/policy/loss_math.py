"""Loss maths: masked reductions, the KL estimators (k1, k2, k3), and the clipped policy-gradient loss.

All tensors are ``[B, T]`` per-token values aligned with ``mask`` (1.0 on response tokens, 0.0 elsewhere)
unless stated. Following NeMo RL, for token ``t`` of response ``i``::

    r      = exp(logp - prev_logp)
    L_clip = max(-A * r, -A * clamp(r, 1 - eps_low, 1 + eps_high))      (optionally dual-clipped)
    x      = clamp(ref_logp - logp, -kl_in, kl_in)
    w      = exp(logp - stop_grad(logp))                                 (1 in value; see kl_gradient_weights)
    kl     = clamp(w * (exp(x) - 1 - x), -kl_out, kl_out)                (k3 estimator of KL(pi || ref))
    L      = L_clip + beta * kl

``w`` adds the score-function term a sampled estimator misses: without it the k3 term's expected gradient
is that of KL(pi_ref || pi), the wrong direction (Tang & Munos 2025; NeMo RL PR #2506). ``k1`` and ``k2``
(``loss_fn.reference_policy_kl_type``) are the other estimators; :func:`kl_gradient_weights` states what
each one's expected gradient is.

and the batch loss is either a token-level mean over every valid token of the *global* batch or a mean of
per-sequence means. ``aggregate`` takes the global normalisers so that micro-batching with gradient
accumulation (and, later, data parallelism) gives the same gradient as one big batch.

Variants (chosen by config at the edge, in :mod:`rlfleet.policy.loss_functions`):

- GSPO (Zheng et al. 2025): one ratio per sequence, ``s_i = exp(mean_t(logp - prev_logp))`` (the geometric
  mean of the token ratios), clipped like the token ratio (:func:`gspo_loss`).
- Dr.GRPO (Liu et al. 2025): each sequence's token losses are summed and divided by a constant length
  instead of the sequence's own length (:func:`aggregate_max_length`), removing the length bias.

DPO (Rafailov et al. 2023) compares two responses to a prompt through their implicit rewards
``r = sum_t (logp - ref_logp)`` (:func:`sequence_sums`, :func:`dpo_preference_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1; 0 when the mask is empty."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


KLType = Literal["k1", "k2", "k3"]
KL_TYPES: tuple[KLType, ...] = ("k1", "k2", "k3")


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kl_type: KLType = "k3",
    input_clamp: float | None = 20.0,
    output_clamp: float | None = 10.0,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' logprobs; ``[B, T]``.

    With ``x = clamp(ref_logp - logp, -input_clamp, input_clamp)`` (Schulman 2020): ``k1 = -x``,
    ``k2 = x^2 / 2``, ``k3 = exp(x) - 1 - x``. ``weights`` (see :func:`kl_gradient_weights`) multiply the
    estimate before the output clamp; where the input clamp is active the weight is detached, so a clamped
    token passes no gradient through either factor (NeMo RL's ``calculate_kl``).
    """
    x = ref_logprobs - logprobs
    if input_clamp is not None:
        clamped = x.clamp(-input_clamp, input_clamp)
        if weights is not None:
            weights = torch.where(x == clamped, weights, weights.detach())
        x = clamped
    if kl_type == "k1":
        kl = -x
    elif kl_type == "k2":
        kl = x.square() / 2
    elif kl_type == "k3":
        kl = torch.exp(x) - 1.0 - x
    else:
        raise ValueError(f"unknown KL estimator {kl_type!r}; choose one of {KL_TYPES}")
    if weights is not None:
        kl = weights * kl
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


def kl_gradient_weights(
    logprobs: torch.Tensor, kl_type: KLType, sampler_logprobs: torch.Tensor | None = None
) -> torch.Tensor:
    """Weights that make the KL term's expected gradient that of KL(pi || pi_ref); ``[B, T]``.

    The tokens are sampled, so a per-token estimate ``k`` differentiated as a loss misses the score-function
    term ``k * grad log pi`` (Tang & Munos 2025, arXiv 2506.09477). Expected gradients, tokens from pi:

    - ``k3``: ``grad k3 = (1 - e^x) grad logp`` gives grad KL(pi_ref || pi), the reverse direction;
      ``k3 * w`` with ``w = exp(logp - stop_grad(logp))`` (1 in value) adds the missing term and gives
      grad KL(pi || pi_ref) (NeMo RL PR #2506).
    - ``k1``: ``grad k1 = grad logp`` has expectation 0; ``k1 * w`` gives grad KL(pi || pi_ref).
    - ``k2``: ``grad k2 = -x grad logp`` already is grad KL(pi || pi_ref); the extra term would add
      ``E[x^2/2 grad logp]``, a bias, so its weight carries no gradient (a departure from NeMo RL, which
      weights k2 like the others).

    ``sampler_logprobs`` (``loss_fn.use_on_policy_kl_approximation``): the tokens came from another policy
    (the generation engine, possibly an older one), so ``w = exp(logp - sampler_logp)`` is also the
    importance weight that turns the sampler's expectation into pi's; for k1/k3 it carries gradient (NeMo
    RL's semantics), for k2 it is detached (only the reweighting is needed). Non-finite weights become 0.
    """
    if sampler_logprobs is None:
        weights = torch.exp(logprobs - logprobs.detach())
    else:
        weights = torch.exp(logprobs - sampler_logprobs)
    weights = torch.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0)
    return weights.detach() if kl_type == "k2" else weights


def kl_k3(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    input_clamp: float | None = 20.0,
    output_clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token k3 value ``exp(x) - 1 - x``, ``x = ref_logp - logp``, without gradient weights; [B, T]."""
    return kl_estimate(logprobs, ref_logprobs, "k3", input_clamp, output_clamp)


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
    return clipped_surrogate(ratio, advantages, eps_low, eps_high, dual_clip_c), ratio


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
) -> torch.Tensor:
    """``max(-A r, -A clamp(r, 1 - eps_low, 1 + eps_high))``, capped at ``-c A`` where ``A < 0`` (dual clip).

    ``ratio`` is ``[B, T]`` (token ratios) or ``[B, 1]`` (sequence ratios); broadcasts with ``advantages``.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        capped = torch.minimum(loss, -advantages * dual_clip_c)
        loss = torch.where(advantages < 0, capped, loss)
    return loss


def sequence_ratio(logprobs: torch.Tensor, prev_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's ``[B, 1]`` sequence ratio ``exp(mean over response tokens of (logp - prev_logp))``.

    The geometric mean of the token ratios, length-normalised; 1 for a row without response tokens.
    """
    log_ratio = ((logprobs - prev_logprobs) * mask).sum(dim=1, keepdim=True)
    return torch.exp(log_ratio / mask.sum(dim=1, keepdim=True).clamp(min=1.0))


def gspo_loss(
    logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: the clipped surrogate on the sequence ratio, broadcast over the response tokens.

    Every token of sequence ``i`` carries the same loss value ``L_i``, so a per-sequence mean
    (``token_level=False``) gives GSPO's sequence objective; the gradient flows through every token of
    the sequence via the mean log ratio. GSPO clips far tighter than GRPO (the paper: 3e-4 / 4e-4).

    Returns:
        ``(loss [B, T], ratio [B, T])``, the sequence ratio repeated over the tokens.
    """
    ratio = sequence_ratio(logprobs, prev_logprobs, mask)  # [B, 1]
    loss = clipped_surrogate(ratio, advantages, eps_low, eps_high, dual_clip_c)
    return loss.expand_as(logprobs), ratio.expand_as(logprobs)


@dataclass(frozen=True)
class Normalizer:
    """Global counts an optimizer step's loss is divided by (summed over micro-batches and ranks)."""

    num_tokens: float
    num_sequences: float
    trained_tokens: float | None = None  # when rows with an exactly-zero loss are skipped: those computed
    trained_sequences: float | None = None

    @property
    def of_trained(self) -> Normalizer:
        """The counts of the rows actually computed: metrics (ratio, clip fraction, ...) average over
        them, while the loss keeps the global counts (a skipped row adds 0 to its numerator, not to its
        denominator)."""
        tokens = self.num_tokens if self.trained_tokens is None else self.trained_tokens
        sequences = self.num_sequences if self.trained_sequences is None else self.trained_sequences
        return Normalizer(tokens, sequences)


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


def aggregate_max_length(
    per_token: torch.Tensor, mask: torch.Tensor, norm: Normalizer, max_length: int
) -> torch.Tensor:
    """Dr.GRPO's constant normaliser: ``sum(per_token * mask) / (norm.num_sequences * max_length)``.

    Each sequence's token losses are summed and divided by the same ``max_length`` (the generation budget),
    then averaged over the global batch's sequences, so no sequence's tokens weigh more for being short.
    Summed over the micro-batches of a step it equals the whole batch's value.
    """
    return masked_sum(per_token, mask) / (max(norm.num_sequences, 1.0) * max_length)


def sequence_sums(per_token: torch.Tensor, mask: torch.Tensor, *, average: bool) -> torch.Tensor:
    """``[B]`` each row's sum of ``per_token`` over ``mask`` (its mean over the masked tokens with
    ``average``; a row without masked tokens gives 0)."""
    sums = (per_token * mask).sum(dim=1)
    return sums / mask.sum(dim=1).clamp(min=1.0) if average else sums


def dpo_preference_loss(chosen: torch.Tensor, rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """``[P]`` DPO's per-pair loss ``-log sigmoid(beta * (r_chosen - r_rejected))`` (``ln 2`` at equal
    rewards), from the pairs' implicit rewards ``r = log pi/pi_ref`` of each response."""
    return -torch.nn.functional.logsigmoid(beta * (chosen - rejected))


def last_token_index(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int | None = None
) -> torch.Tensor:
    """``[B]`` the position of each right-padded row's last real token (``attention_mask``), where a
    sequence classifier reads the row's score. With ``pad_token_id``: its last real token that is not the
    padding id, transformers' rule for ``*ForSequenceClassification`` (the rightmost token that is not
    padding), so that a reward model trained here reads the position its export reads, also where the
    padding id is a real token as well (padding = EOS). A row with no such token gives 0."""
    real = attention_mask != 0
    if pad_token_id is not None:
        real = real & (input_ids != pad_token_id)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (positions * real).argmax(dim=1)
