"""On-policy distillation maths: the teacher's top-k, the student read at the teacher's tokens, and the
per-token KL between them, with NeMo RL's semantics (``DistillationLossFn`` and
``get_distillation_topk_logprobs_from_logits``).

For each position the teacher keeps its ``k`` largest logits and their token ids; its distribution is
renormalised over those ``k`` (``log_softmax`` of the ``k`` logits). The student is read at the same ids:

* ``zero_outside_topk=False``: the student's logits at the ids, renormalised over the ``k`` as well, so both
  are distributions over the same ``k`` tokens;
* ``zero_outside_topk=True``: the student's full-vocabulary ``log_softmax`` gathered at the ids (it does not
  sum to 1 over them), plus ``sum_v p_S(v) log p_S(v)`` over the whole vocabulary for the mass outside.

Per token, with ``w = mixed_kl_weight``::

    forward = sum_k p_T (log p_T - log p_S)
    reverse = sum_k p_S (log p_S - log p_T)  [+ sum_{v outside} p_S(v) (log p_S(v) - LOG_INFINITESIMAL)]
    mixed   = w * forward + (1 - w) * reverse

The bracket is NeMo's correction with ``zero_outside_topk``: outside its top k the teacher's probability is
taken as ``exp(LOG_INFINITESIMAL)``, so the student's mass there is penalised (in ``mixed``, weighted by
``1 - w`` as the reverse term is). With ``k`` equal to the vocabulary every form is the exact KL.
"""

from __future__ import annotations

from typing import Literal

import torch

DistillationKL = Literal["forward", "reverse", "mixed"]
KL_TYPES: tuple[DistillationKL, ...] = ("forward", "reverse", "mixed")
LOG_INFINITESIMAL = -100.0  # NeMo RL's log-probability of a token outside the teacher's top k

# Token ids travel beside the teacher's logprobs in one float32 tensor (``teacher_topk``); float32 holds
# every integer below 2**24 exactly, far above any vocabulary (Gemma 3: 262,144).
MAX_EXACT_ID = 2**24


def teacher_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's ``k`` largest logits of each position, renormalised: ``(logprobs [..., k] float32,
    ids [..., k] long)``, largest first."""
    if not 0 < k <= logits.shape[-1]:
        raise ValueError(f"top-k of {k} from a vocabulary of {logits.shape[-1]}: k must be in 1..vocabulary")
    values, ids = logits.float().topk(k, dim=-1)
    return torch.log_softmax(values, dim=-1), ids


def student_at_ids(
    logits: torch.Tensor, ids: torch.Tensor, *, zero_outside_topk: bool, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The student's logprobs at the teacher's ``ids`` ``[..., k]`` from its ``[..., V]`` logits, and with
    ``with_entropy`` (``zero_outside_topk`` only) ``sum_v p log p`` over the vocabulary ``[...]``.

    ``zero_outside_topk=False`` renormalises over the ``k`` ids; ``True`` gathers the full log-softmax.
    Float32 (float64 stays float64)."""
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if not zero_outside_topk:
        return torch.log_softmax(logits.gather(-1, ids), dim=-1), None
    full = torch.log_softmax(logits, dim=-1)
    neg_entropy = (full.exp() * full).sum(-1) if with_entropy else None
    return full.gather(-1, ids), neg_entropy


def needs_entropy(kl_type: DistillationKL, zero_outside_topk: bool) -> bool:
    """Whether the loss reads the student's whole-vocabulary ``sum p log p`` (NeMo: only a reverse term
    with ``zero_outside_topk`` does)."""
    return zero_outside_topk and kl_type != "forward"


def distillation_kl(
    student: torch.Tensor,
    teacher: torch.Tensor,
    kl_type: DistillationKL,
    mixed_kl_weight: float = 0.5,
    neg_entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL ``[...]`` between the teacher's and the student's top-k logprobs ``[..., k]``.

    ``neg_entropy`` (the student's ``sum_v p log p`` over the whole vocabulary, from ``student_at_ids`` with
    ``zero_outside_topk``) adds the reverse term of the mass outside the top k; None leaves it out, as for
    renormalised top-k or a ``forward`` KL.
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"unknown distillation KL {kl_type!r}; choose one of {KL_TYPES}")
    if not 0.0 <= mixed_kl_weight <= 1.0:
        raise ValueError(f"mixed_kl_weight must be in [0, 1], got {mixed_kl_weight}")
    p_student, p_teacher = student.exp(), teacher.exp()
    forward = p_teacher * (teacher - student)
    reverse = p_student * (student - teacher)
    if kl_type == "forward":
        per_token = forward.sum(-1)
    elif kl_type == "reverse":
        per_token = reverse.sum(-1)
    else:
        per_token = (mixed_kl_weight * forward + (1.0 - mixed_kl_weight) * reverse).sum(-1)
    if neg_entropy is not None and kl_type != "forward":
        outside = (neg_entropy - (p_student * student).sum(-1)) - LOG_INFINITESIMAL * (1 - p_student.sum(-1))
        per_token = per_token + outside * (1.0 if kl_type == "reverse" else 1.0 - mixed_kl_weight)
    return per_token
