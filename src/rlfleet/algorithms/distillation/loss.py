"""On-policy distillation's loss, applied by the policy worker to one micro-batch (the interface of
:mod:`rlfleet.policy.loss_functions`), over the KL maths of :mod:`rlfleet.algorithms.distillation.kl`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from rlfleet.algorithms.distillation.kl import KL_TYPES as DISTILLATION_KL_TYPES
from rlfleet.algorithms.distillation.kl import (
    DistillationKL,
    distillation_kl,
    needs_entropy,
    student_at_ids,
)
from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.logprobs import Readout
from rlfleet.policy.loss_functions import required
from rlfleet.policy.loss_math import Normalizer, aggregate


@dataclass(frozen=True)
class DistillationLossFn:
    """On-policy distillation (NeMo RL's ``DistillationLossFn``): the per-token KL between the teacher's
    top-k distribution (``batch.teacher_topk_logprobs``, at ``batch.teacher_topk_ids``) and the student's at
    the same tokens, a mean over the global batch's response tokens (a multi-turn episode: the model's own
    turns). ``kl_type`` forward, reverse or mixed (``mixed_kl_weight`` weighs the forward term);
    ``zero_outside_topk`` reads the student's full-vocabulary logprobs instead of renormalising over the k
    (see :mod:`rlfleet.algorithms.distillation.kl`).

    Its input is not the tokens' logprobs: the worker's forward reads the student at the teacher's ids
    (``readout``), ``[n, T, k + 1]``: the k logprobs, then the student's ``sum p log p`` over its vocabulary
    (0 where the loss does not need it).

    Metrics: ``loss`` and ``num_valid_samples`` (NeMo's), ``teacher_top1_agreement`` (the share of response
    tokens where the student's most likely of the k is the teacher's) and ``student_topk_mass`` (with
    ``zero_outside_topk``: the student's probability on the teacher's k, 1 otherwise).
    """

    kl_type: DistillationKL = "mixed"
    mixed_kl_weight: float = 0.5
    zero_outside_topk: bool = False

    def __post_init__(self) -> None:
        if self.kl_type not in DISTILLATION_KL_TYPES:
            raise ValueError(
                f"unknown distillation KL {self.kl_type!r}; choose one of {DISTILLATION_KL_TYPES}"
            )
        if not 0.0 <= self.mixed_kl_weight <= 1.0:
            raise ValueError(f"mixed_kl_weight must be in [0, 1], got {self.mixed_kl_weight}")

    @property
    def readout(self) -> Readout:
        entropy = needs_entropy(self.kl_type, self.zero_outside_topk)
        pick = functools.partial(_student_at_teacher_ids, self.zero_outside_topk, entropy)
        return Readout(targets=_topk_ids, pick=pick)

    def __call__(
        self, read: torch.Tensor, mb: TrainBatch, norm: Normalizer
    ) -> tuple[torch.Tensor, dict[str, float]]:
        teacher = required(mb.teacher_topk_logprobs, "teacher_topk_logprobs").to(read.device)
        student = read[..., :-1]
        if student.shape != teacher.shape:
            raise ValueError(
                f"the student was read at {student.shape[-1]} tokens per position but the teacher gave "
                f"{teacher.shape[-1]}"
            )
        entropy = read[..., -1] if needs_entropy(self.kl_type, self.zero_outside_topk) else None
        per_token = distillation_kl(student, teacher, self.kl_type, self.mixed_kl_weight, entropy)
        mask = mb.response_mask
        loss = aggregate(per_token, mask, norm, True)
        with torch.no_grad():
            agree = (student.argmax(-1) == teacher.argmax(-1)).float()
            metrics = {
                "loss": float(loss.detach()),
                "num_valid_samples": float(len(mb)),
                "teacher_top1_agreement": float(aggregate(agree, mask, norm, True)),
                "student_topk_mass": float(aggregate(student.exp().sum(-1), mask, norm, True)),
            }
        return loss, metrics


def _topk_ids(mb: TrainBatch) -> torch.Tensor:
    return required(mb.teacher_topk_ids, "teacher_topk_ids")


def _student_at_teacher_ids(
    zero_outside_topk: bool, with_entropy: bool, logits: torch.Tensor, ids: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``[..., k + 1]``: the student's logprobs at the teacher's ``ids``, then its ``sum p log p`` (or 0)."""
    if temperature != 1.0:
        logits = logits.float() / temperature
    student, neg_entropy = student_at_ids(
        logits, ids, zero_outside_topk=zero_outside_topk, with_entropy=with_entropy
    )
    last = neg_entropy if neg_entropy is not None else student.new_zeros(student.shape[:-1])
    return torch.cat([student, last.unsqueeze(-1)], dim=-1)
