"""Loss functions applied by the policy worker to one micro-batch.

A loss function is called as ``loss_fn(logprobs, micro_batch, normalizer) -> (loss, metrics)`` where the
returned loss is this micro-batch's share of the global loss (see ``rlfleet.policy.loss.aggregate``) and
``metrics`` holds *sums* over the micro-batch that the worker adds up and divides at the end.

Metric sums are divided by the global normalisers (``aggregate``), so summed over micro-batches and ranks
they are global means over the step's response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.loss import Normalizer, aggregate, clipped_pg_loss, kl_k3

KL_ESTIMATORS = {"k3": kl_k3}


def _required(value: torch.Tensor | None, name: str) -> torch.Tensor:
    if value is None:
        raise ValueError(f"the clipped policy-gradient loss needs batch.{name}; compute it before training")
    return value


@dataclass(frozen=True)
class ClippedPGLossFn:
    """GRPO's loss: clipped policy gradient plus ``kl_penalty`` x k3 KL to the reference policy.

    ``prev_from_training_forward``: the batch is trained on by exactly one optimizer step, so the policy that
    produced it is the one being trained: the previous-policy logprobs are this forward's own, detached
    (``batch.prev_logprobs`` must then be None). The ratio is 1 in value and the gradient of the clipped
    objective is the policy gradient, as with a separately computed ``prev``, without the extra pass.

    Besides the loss it reports ``gen_logprob_error``, the mean ``|prev - generation logprobs|`` over response
    tokens, when the batch carries generation logprobs.
    """

    eps_low: float
    eps_high: float
    dual_clip_c: float | None
    kl_penalty: float
    kl_input_clamp: float | None
    kl_output_clamp: float | None
    token_level: bool
    importance_sampling_correction: bool
    kl_type: str = "k3"
    prev_from_training_forward: bool = False

    def __post_init__(self) -> None:
        if self.kl_type not in KL_ESTIMATORS:
            raise ValueError(f"unknown KL estimator {self.kl_type!r}; choose one of {sorted(KL_ESTIMATORS)}")

    def __call__(
        self, logprobs: torch.Tensor, mb: TrainBatch, norm: Normalizer
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb.response_mask
        prev = self._prev_logprobs(logprobs, mb)
        adv = _required(mb.advantages, "advantages").unsqueeze(1)  # [B, 1]
        pg, ratio = clipped_pg_loss(logprobs, prev, adv, self.eps_low, self.eps_high, self.dual_clip_c)
        per_token = pg
        if self.importance_sampling_correction:
            gen = _required(mb.generation_logprobs, "generation_logprobs")
            per_token = per_token * torch.exp(prev - gen).detach()
        kl = torch.zeros_like(logprobs)
        if self.kl_penalty > 0:
            ref = _required(mb.ref_logprobs, "ref_logprobs")
            kl = KL_ESTIMATORS[self.kl_type](logprobs, ref, self.kl_input_clamp, self.kl_output_clamp)
            per_token = per_token + self.kl_penalty * kl
        loss = aggregate(per_token, mask, norm, self.token_level)
        with torch.no_grad():
            clipped = ((ratio < 1 - self.eps_low) | (ratio > 1 + self.eps_high)).float()
            metrics = {
                "loss": float(loss.detach()),
                "kl": float(aggregate(kl, mask, norm, True)),
                "ratio": float(aggregate(ratio, mask, norm, True)),
                "clip_fraction": float(aggregate(clipped, mask, norm, True)),
            }
            if mb.generation_logprobs is not None:
                error = (prev - mb.generation_logprobs).abs()
                metrics["gen_logprob_error"] = float(aggregate(error, mask, norm, True))
        return loss, metrics

    def _prev_logprobs(self, logprobs: torch.Tensor, mb: TrainBatch) -> torch.Tensor:
        if not self.prev_from_training_forward:
            return _required(mb.prev_logprobs, "prev_logprobs")
        if mb.prev_logprobs is not None:
            raise ValueError(
                "prev_from_training_forward takes the previous-policy logprobs from the training forward, "
                "but the batch also carries prev_logprobs: compute one or the other, not both"
            )
        return logprobs.detach()


@dataclass(frozen=True)
class NLLLossFn:
    """Supervised fine-tuning: mean negative log-likelihood of the response tokens."""

    token_level: bool = True

    def __call__(
        self, logprobs: torch.Tensor, mb: TrainBatch, norm: Normalizer
    ) -> tuple[torch.Tensor, dict[str, float]]:
        loss = aggregate(-logprobs, mb.response_mask, norm, self.token_level)
        return loss, {"loss": float(loss.detach())}
