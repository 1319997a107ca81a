"""Loss functions applied by the policy worker to one micro-batch.

A loss function is called as ``loss_fn(logprobs, micro_batch, normalizer) -> (loss, metrics)`` where the
returned loss is this micro-batch's share of the global loss (see ``rlfleet.policy.loss_math.aggregate``) and
``metrics`` holds *sums* over the micro-batch that the worker adds up and divides at the end.

Metric sums are divided by the global normalisers (``aggregate``), so summed over micro-batches and ranks
they are global means over the step's response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.importance_sampling import (
    TRUNCATION_TYPES,
    ImportanceWeights,
    TruncationType,
    importance_weights,
)
from rlfleet.policy.loss_math import (
    KL_TYPES,
    KLType,
    Normalizer,
    aggregate,
    aggregate_max_length,
    clipped_pg_loss,
    dpo_preference_loss,
    gspo_loss,
    kl_estimate,
    kl_gradient_weights,
    last_token_index,
    sequence_sums,
)


def trained_mask(mask: torch.Tensor, inert: torch.Tensor | None) -> torch.Tensor:
    """``mask`` ``[B, T]`` with the ``inert`` rows (``[B]`` bool, or None for none) zeroed."""
    return mask if inert is None else mask * (~inert.to(mask.device)).unsqueeze(1).to(mask.dtype)


def required(value: torch.Tensor | None, name: str) -> torch.Tensor:
    if value is None:
        raise ValueError(f"this loss needs batch.{name}; compute it before training")
    return value


@dataclass(frozen=True)
class ClippedPGLossFn:
    """GRPO's loss: clipped policy gradient plus ``kl_penalty`` x an estimate of KL(pi || pi_ref).

    The KL estimator is ``kl_type`` (k1, k2, k3), weighted so that its expected gradient is that of
    KL(pi || pi_ref) (:func:`~rlfleet.policy.loss_math.kl_gradient_weights`); with
    ``use_on_policy_kl_approximation`` the weight is also the importance ratio ``pi / pi_gen`` against the
    generation engine's logprobs, which the batch must then carry (NeMo RL's key of that name).

    ``prev_from_training_forward``: the batch is trained on by exactly one optimizer step, so the policy that
    produced it is the one being trained: the previous-policy logprobs are this forward's own, detached
    (``batch.prev_logprobs`` must then be None). The ratio is 1 in value and the gradient of the clipped
    objective is the policy gradient, as with a separately computed ``prev``, without the extra pass.

    Variants, each a pure function of :mod:`rlfleet.policy.loss_math` or
    :mod:`rlfleet.policy.importance_sampling`:
    ``sequence_level_ratios`` (GSPO: one ratio per sequence, needs ``token_level=False``),
    ``max_length`` (Dr.GRPO: token sums divided by a constant length, needs ``token_level=False``), and the
    importance-sampling correction (``importance_sampling_correction``) bounded by ``truncation``
    (``tis``/``icepop``/``seq-mask-tis``, see :func:`~rlfleet.policy.importance_sampling.importance_weights`).

    Besides the loss it reports ``gen_logprob_error``, the mean ``|prev - generation logprobs|`` over response
    tokens, when the batch carries generation logprobs; with the correction, ``sampling_importance_ratio``
    (the mean weight applied) and, with a bound, ``is_oob_ratio`` (the share of tokens, or for
    ``seq-mask-tis`` of sequences, the bound truncated or masked) under NeMo RL's names.
    """

    eps_low: float
    eps_high: float
    dual_clip_c: float | None
    kl_penalty: float
    kl_input_clamp: float | None
    kl_output_clamp: float | None
    token_level: bool
    importance_sampling_correction: bool
    kl_type: KLType = "k3"
    use_on_policy_kl_approximation: bool = False
    prev_from_training_forward: bool = False
    truncation: TruncationType | None = None
    truncation_ratio_max: float | None = None
    truncation_ratio_min: float | None = None
    sequence_level_ratios: bool = False
    max_length: int | None = None

    def __post_init__(self) -> None:
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"unknown KL estimator {self.kl_type!r}; choose one of {KL_TYPES}")
        if self.truncation is not None and not self.importance_sampling_correction:
            raise ValueError(
                f"truncation {self.truncation!r} bounds the importance-sampling correction, which is off"
            )
        bounds = (self.truncation_ratio_max, self.truncation_ratio_min)
        if self.truncation is None and any(b is not None for b in bounds):
            raise ValueError(
                f"truncation bounds (max={bounds[0]}, min={bounds[1]}) are set without a truncation type; "
                f"choose one of {TRUNCATION_TYPES}"
            )
        low, high = self.truncation_ratio_min, self.truncation_ratio_max
        if low is not None and high is not None and low > high:
            raise ValueError(f"importance-sampling bounds need min <= max, got min={low} > max={high}")
        if self.truncation is not None and self.truncation not in TRUNCATION_TYPES:
            raise ValueError(f"unknown truncation {self.truncation!r}; choose one of {TRUNCATION_TYPES}")
        if (self.sequence_level_ratios or self.max_length is not None) and self.token_level:
            raise ValueError(
                "sequence-level ratios (GSPO) and the constant normaliser (Dr.GRPO) aggregate "
                "per sequence: token_level must be False"
            )
        if self.sequence_level_ratios and self.max_length is not None:
            raise ValueError("GSPO's sequence ratios and Dr.GRPO's constant normaliser do not combine")

    def __call__(
        self, logprobs: torch.Tensor, mb: TrainBatch, norm: Normalizer
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb.response_mask
        prev = self._prev_logprobs(logprobs, mb)
        adv = required(mb.advantages, "advantages").unsqueeze(1)  # [B, 1]
        if self.sequence_level_ratios:
            pg, ratio = gspo_loss(logprobs, prev, adv, mask, self.eps_low, self.eps_high, self.dual_clip_c)
        else:
            pg, ratio = clipped_pg_loss(logprobs, prev, adv, self.eps_low, self.eps_high, self.dual_clip_c)
        per_token, metrics = pg, {}
        # the metrics are means over the rows trained: an inert row computed only so that the ranks run
        # equal passes (or the optimizer steps on a zero gradient) counts in neither sum nor count, and
        # with no row trained there is no mean to report
        trained, measured_mask = norm.of_trained, trained_mask(mask, mb.inert)
        measured = trained.num_tokens > 0
        if self.importance_sampling_correction:
            is_weights = self._importance_weights(prev, mb)
            per_token = per_token * is_weights.weights
            metrics = _importance_metrics(is_weights, measured_mask, trained) if measured else {}
        kl = torch.zeros_like(logprobs)
        if self.kl_penalty > 0:
            kl = self._kl(logprobs, mb)
            per_token = per_token + self.kl_penalty * kl
        loss = self._aggregate(per_token, mask, norm)
        metrics["loss"] = float(loss.detach())
        if not measured:
            return loss, metrics
        with torch.no_grad():
            clipped = ((ratio < 1 - self.eps_low) | (ratio > 1 + self.eps_high)).float()
            metrics |= {
                "kl": float(aggregate(kl, measured_mask, trained, True)),
                "ratio": float(aggregate(ratio, measured_mask, trained, True)),
                "clip_fraction": float(aggregate(clipped, measured_mask, trained, True)),
            }
            if mb.generation_logprobs is not None:
                error = (prev - mb.generation_logprobs).abs()
                metrics["gen_logprob_error"] = float(aggregate(error, measured_mask, trained, True))
        return loss, metrics

    def _kl(self, logprobs: torch.Tensor, mb: TrainBatch) -> torch.Tensor:
        """Per-token weighted KL estimate ``[B, T]``: 1-valued weights (or ``pi / pi_gen``) whose gradient
        supplies the score-function term."""
        ref = required(mb.ref_logprobs, "ref_logprobs")
        sampler = None
        if self.use_on_policy_kl_approximation:
            sampler = required(mb.generation_logprobs, "generation_logprobs")
        weights = kl_gradient_weights(logprobs, self.kl_type, sampler)
        return kl_estimate(logprobs, ref, self.kl_type, self.kl_input_clamp, self.kl_output_clamp, weights)

    def _aggregate(self, per_token: torch.Tensor, mask: torch.Tensor, norm: Normalizer) -> torch.Tensor:
        if self.max_length is not None:
            return aggregate_max_length(per_token, mask, norm, self.max_length)
        return aggregate(per_token, mask, norm, self.token_level)

    def _importance_weights(self, prev: torch.Tensor, mb: TrainBatch) -> ImportanceWeights:
        return importance_weights(
            prev.detach(),
            required(mb.generation_logprobs, "generation_logprobs"),
            mb.response_mask,
            sequence_level=self.sequence_level_ratios,
            truncation=self.truncation,
            ratio_max=self.truncation_ratio_max,
            ratio_min=self.truncation_ratio_min,
        )

    def _prev_logprobs(self, logprobs: torch.Tensor, mb: TrainBatch) -> torch.Tensor:
        if not self.prev_from_training_forward:
            return required(mb.prev_logprobs, "prev_logprobs")
        if mb.prev_logprobs is not None:
            raise ValueError(
                "prev_from_training_forward takes the previous-policy logprobs from the training forward, "
                "but the batch also carries prev_logprobs: compute one or the other, not both"
            )
        return logprobs.detach()


def _importance_metrics(w: ImportanceWeights, mask: torch.Tensor, norm: Normalizer) -> dict[str, float]:
    """Mean weight over response tokens and, with a bound, the share of tokens (or sequences) it hit."""
    with torch.no_grad():
        metrics = {"sampling_importance_ratio": float(aggregate(w.weights.expand_as(mask), mask, norm, True))}
        if w.out_of_band is None:
            return metrics
        if w.out_of_band.ndim == 1:  # sequences masked: share of the global batch's sequences
            has_tokens = (mask.sum(dim=1) > 0).to(mask.dtype)
            share = (w.out_of_band * has_tokens).sum() / max(norm.num_sequences, 1.0)
        else:
            share = aggregate(w.out_of_band.expand_as(mask), mask, norm, True)
        metrics["is_oob_ratio"] = float(share)
        return metrics


@dataclass(frozen=True)
class NLLLossFn:
    """Supervised fine-tuning: mean negative log-likelihood of the response tokens."""

    token_level: bool = True

    def __call__(
        self, logprobs: torch.Tensor, mb: TrainBatch, norm: Normalizer
    ) -> tuple[torch.Tensor, dict[str, float]]:
        loss = aggregate(-logprobs, mb.response_mask, norm, self.token_level)
        return loss, {"loss": float(loss.detach())}


@dataclass(frozen=True)
class DPOLossFn:
    """DPO (NeMo RL's ``DPOLossFn``): ``w_pref * mean(-log sigmoid(beta * (r_chosen - r_rejected)))``
    ``+ w_sft * mean(NLL(chosen))``, the means over the global batch's pairs.

    ``r`` is the sum over response tokens of ``logp - ref_logp`` (the mean with
    ``preference_average_log_probs``); the SFT term is the chosen response's summed negative logprob (its
    mean with ``sft_average_log_probs``). Rows ``2i`` and ``2i + 1`` of a micro-batch are a pair's chosen
    and rejected responses: the trainer plans its micro-batches in pairs (``MicroBatching.pairs``).

    Metrics, NeMo RL's: ``loss``, ``sft_loss`` (the SFT term before its weight; 0 when ``sft_loss_weight``
    is 0, which computes none), ``preference_loss``, ``accuracy`` (pairs whose chosen
    reward is higher), ``rewards_chosen_mean``, ``rewards_rejected_mean`` (``r``, without beta) and
    ``num_valid_samples`` (pairs).
    """

    reference_policy_kl_penalty: float = 0.05  # beta
    preference_loss_weight: float = 1.0
    sft_loss_weight: float = 0.0
    preference_average_log_probs: bool = False
    sft_average_log_probs: bool = False

    def __call__(
        self, logprobs: torch.Tensor, mb: TrainBatch, norm: Normalizer
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if len(mb) % 2:
            raise ValueError(f"a DPO micro-batch holds whole (chosen, rejected) pairs, got {len(mb)} rows")
        mask, pairs = mb.response_mask, max(norm.num_sequences / 2, 1.0)
        ref = required(mb.ref_logprobs, "ref_logprobs")
        rewards = sequence_sums(logprobs - ref, mask, average=self.preference_average_log_probs)
        chosen, rejected = rewards[0::2], rewards[1::2]
        preference = dpo_preference_loss(chosen, rejected, self.reference_policy_kl_penalty).sum() / pairs
        if self.sft_loss_weight > 0:
            sft = sequence_sums(-logprobs[0::2], mask[0::2], average=self.sft_average_log_probs).sum() / pairs
        else:  # NeMo RL computes no SFT term without its weight, and logs 0 for it
            sft = torch.zeros((), device=logprobs.device)
        loss = self.preference_loss_weight * preference + self.sft_loss_weight * sft
        with torch.no_grad():
            metrics = {
                "loss": float(loss.detach()),
                "sft_loss": float(sft),
                "preference_loss": float(preference),
                "accuracy": float((chosen > rejected).float().sum() / pairs),
                "rewards_chosen_mean": float(chosen.sum() / pairs),
                "rewards_rejected_mean": float(rejected.sum() / pairs),
                "num_valid_samples": len(mb) / 2,
            }
        return loss, metrics


@dataclass(frozen=True)
class PreferenceLossFn:
    """A Bradley-Terry reward model's loss (NeMo RL's ``PreferenceLossFn``): ``mean(-log sigmoid(r_chosen -
    r_rejected))`` over the global batch's pairs, ``r`` a sequence's score, the reward model's output at
    its last token (``last_token_index``: with ``pad_token_id``, transformers' rule, so the exported model
    reads the same position).

    Its input is the reward model's per-token scores ``[n, T]`` (what the policy worker computes for a
    reward model where it computes logprobs for a causal LM). Rows ``2i`` and ``2i + 1`` of a micro-batch are
    a pair's chosen and rejected sequences, planned together (``MicroBatching.pairs``).

    Metrics, NeMo RL's: ``loss``, ``accuracy`` (pairs whose chosen score is higher),
    ``rewards_chosen_mean``, ``rewards_rejected_mean`` and ``num_valid_samples`` (pairs).
    """

    pad_token_id: int | None = None

    def __call__(
        self, scores: torch.Tensor, mb: TrainBatch, norm: Normalizer
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if len(mb) % 2:
            raise ValueError(
                f"a preference micro-batch holds whole (chosen, rejected) pairs, got {len(mb)} rows"
            )
        pairs = max(norm.num_sequences / 2, 1.0)
        index = last_token_index(mb.input_ids, mb.attention_mask, self.pad_token_id).to(scores.device)
        rewards = scores.gather(1, index.unsqueeze(1)).squeeze(1)  # [n]
        chosen, rejected = rewards[0::2], rewards[1::2]
        loss = dpo_preference_loss(chosen, rejected, beta=1.0).sum() / pairs
        with torch.no_grad():
            metrics = {
                "loss": float(loss.detach()),
                "accuracy": float((chosen > rejected).float().sum() / pairs),
                "rewards_chosen_mean": float(chosen.sum() / pairs),
                "rewards_rejected_mean": float(rejected.sum() / pairs),
                "num_valid_samples": len(mb) / 2,
            }
        return loss, metrics
