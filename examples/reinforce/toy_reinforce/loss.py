"""The loss: ``-A * log pi(token)`` averaged over the response tokens (the policy worker calls it per
micro-batch, as every rlfleet loss)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.loss_functions import required
from rlfleet.policy.loss_math import Normalizer, aggregate


@dataclass(frozen=True)
class ReinforceLossFn:
    def __call__(
        self, logprobs: torch.Tensor, mb: TrainBatch, norm: Normalizer
    ) -> tuple[torch.Tensor, dict[str, float]]:
        advantages = required(mb.advantages, "advantages").unsqueeze(1)  # [B, 1]
        loss = aggregate(-advantages * logprobs, mb.response_mask, norm, True)
        return loss, {"loss": float(loss.detach())}
