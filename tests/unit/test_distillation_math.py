"""The distillation maths (rlfleet.algorithms.distillation.kl) against closed forms.

With ``k`` equal to the vocabulary, every ``kl_type`` in both ``zero_outside_topk`` modes is the exact KL,
so its value and its gradient are checked against ``torch.distributions.kl_divergence`` by autograd in
float64 (to 1e-9). Below the vocabulary, hand values. The behavioural cases of NeMo RL's
``tests/unit/algorithms/test_loss_functions.py`` (``test_distillation_loss_topk_filtering``,
``test_distillation_loss_invalid_k_zero``, ``test_distillation_loss_gradient_flow``,
``test_distillation_loss_edge_cases``, ``test_distillation_loss_different_settings``) are rebuilt on the CPU:
their expected values come from CUDA random draws, so the shapes and properties are ported, not the numbers.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from rlfleet.algorithms.distillation.kl import (
    KL_TYPES,
    LOG_INFINITESIMAL,
    distillation_kl,
    needs_entropy,
    student_at_ids,
    teacher_topk,
)

WEIGHT = 0.3  # NeMo's test_distillation_loss_different_settings uses mixed_kl_weight 0.3


def _per_token(student_logits, teacher_logits, k, kl_type, zero_outside_topk, weight=WEIGHT):
    teacher, ids = teacher_topk(teacher_logits, k)
    student, neg_entropy = student_at_ids(
        student_logits,
        ids,
        zero_outside_topk=zero_outside_topk,
        with_entropy=needs_entropy(kl_type, zero_outside_topk),
    )
    return distillation_kl(student, teacher.to(student.dtype), kl_type, weight, neg_entropy)


def _exact(student_logits, teacher_logits, kl_type, weight=WEIGHT):
    s, t = Categorical(logits=student_logits), Categorical(logits=teacher_logits)
    forward, reverse = kl_divergence(t, s), kl_divergence(s, t)
    return {"forward": forward, "reverse": reverse, "mixed": weight * forward + (1 - weight) * reverse}[
        kl_type
    ]


@pytest.mark.parametrize("zero_outside_topk", [False, True])
@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_with_k_equal_to_the_vocabulary_value_and_gradient_are_the_exact_kl(kl_type, zero_outside_topk):
    gen = torch.Generator().manual_seed(0)
    teacher_logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64) * 2
    student_logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64).requires_grad_(True)
    # teacher_topk works in float32 like the teacher pass; the exact comparison needs float64 throughout
    values, ids = teacher_logits.topk(11, dim=-1)
    student, neg_entropy = student_at_ids(
        student_logits, ids, zero_outside_topk=zero_outside_topk, with_entropy=zero_outside_topk
    )
    ours = distillation_kl(student, torch.log_softmax(values, -1), kl_type, WEIGHT, neg_entropy)
    (grad,) = torch.autograd.grad(ours.sum(), student_logits)
    exact = _exact(student_logits, teacher_logits, kl_type)
    (exact_grad,) = torch.autograd.grad(exact.sum(), student_logits)
    torch.testing.assert_close(ours, exact, atol=1e-9, rtol=0)
    torch.testing.assert_close(grad, exact_grad, atol=1e-9, rtol=0)


def test_float32_top_k_equal_to_the_vocabulary_matches_the_exact_kl():
    gen = torch.Generator().manual_seed(1)
    teacher_logits, student_logits = torch.randn(2, 4, 7, generator=gen), torch.randn(2, 4, 7, generator=gen)
    for kl_type in KL_TYPES:
        ours = _per_token(student_logits, teacher_logits, 7, kl_type, zero_outside_topk=False)
        torch.testing.assert_close(ours, _exact(student_logits, teacher_logits, kl_type), atol=1e-5, rtol=0)


# Hand values: vocabulary 4, teacher logits (2, 1, 0, -1), k = 2 keeps tokens 0 and 1 with
# p_T = (e, 1) / (e + 1); the student is uniform (logits 0).
P0, P1 = math.e / (math.e + 1), 1 / (math.e + 1)
H_T = -(P0 * math.log(P0) + P1 * math.log(P1))  # the teacher's renormalised entropy
TEACHER = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
UNIFORM = torch.zeros(1, 4)


def test_hand_values_with_the_student_renormalised_over_the_top_k():
    # both over tokens {0, 1}: the student is (1/2, 1/2)
    forward = math.log(2) - H_T
    reverse = 0.5 * (math.log(0.5) - math.log(P0)) + 0.5 * (math.log(0.5) - math.log(P1))
    expected = {"forward": forward, "reverse": reverse, "mixed": WEIGHT * forward + (1 - WEIGHT) * reverse}
    for kl_type, value in expected.items():
        got = _per_token(UNIFORM, TEACHER, 2, kl_type, zero_outside_topk=False)
        assert got.item() == pytest.approx(value, abs=1e-6), kl_type


def test_hand_values_with_the_students_whole_vocabulary():
    # the student's logprob at each kept token is log(1/4); half its mass lies outside the top k
    forward = math.log(4) - H_T
    inside = 0.25 * (math.log(0.25) - math.log(P0)) + 0.25 * (math.log(0.25) - math.log(P1))
    outside = 2 * 0.25 * math.log(0.25) - LOG_INFINITESIMAL * 0.5  # sum_rest p log p - log(eps) * P_rest
    reverse = inside + outside
    mixed = WEIGHT * forward + (1 - WEIGHT) * inside + (1 - WEIGHT) * outside
    for kl_type, value in {"forward": forward, "reverse": reverse, "mixed": mixed}.items():
        got = _per_token(UNIFORM, TEACHER, 2, kl_type, zero_outside_topk=True)
        assert got.item() == pytest.approx(value, abs=1e-5), kl_type


@pytest.mark.parametrize("zero_outside_topk", [False, True])
def test_mixed_at_weights_one_and_zero_is_forward_and_reverse(zero_outside_topk):
    gen = torch.Generator().manual_seed(2)
    teacher_logits, student_logits = torch.randn(2, 3, 9, generator=gen), torch.randn(2, 3, 9, generator=gen)
    forward = _per_token(student_logits, teacher_logits, 4, "forward", zero_outside_topk)
    reverse = _per_token(student_logits, teacher_logits, 4, "reverse", zero_outside_topk)
    mixed_one = _per_token(student_logits, teacher_logits, 4, "mixed", zero_outside_topk, weight=1.0)
    mixed_zero = _per_token(student_logits, teacher_logits, 4, "mixed", zero_outside_topk, weight=0.0)
    torch.testing.assert_close(mixed_one, forward)
    torch.testing.assert_close(mixed_zero, reverse)


def test_teacher_top_k_is_largest_first_and_renormalised():
    logprobs, ids = teacher_topk(torch.tensor([[0.5, 3.0, -1.0, 2.0]]), 3)
    assert ids.tolist() == [[1, 3, 0]]
    assert logprobs.exp().sum().item() == pytest.approx(1.0)
    assert logprobs.dtype == torch.float32 and ids.dtype == torch.long


@pytest.mark.parametrize("k", [0, 5])
def test_top_k_outside_one_to_the_vocabulary_is_refused(k):
    # NeMo: test_distillation_loss_invalid_k_zero ("topk must be positive"); above the vocabulary too
    with pytest.raises(ValueError, match=r"k must be in 1\.\.vocabulary"):
        teacher_topk(torch.zeros(2, 4), k)


@pytest.mark.parametrize("zero_outside_topk", [False, True])
def test_top_one_is_finite_and_renormalised_forward_kl_is_zero(zero_outside_topk):
    # NeMo: test_distillation_loss_topk_filtering with k = 1
    gen = torch.Generator().manual_seed(3)
    teacher_logits, student_logits = torch.randn(2, 4, 8, generator=gen), torch.randn(2, 4, 8, generator=gen)
    got = _per_token(student_logits, teacher_logits, 1, "forward", zero_outside_topk)
    assert torch.isfinite(got).all()
    if not zero_outside_topk:  # one token renormalised is probability 1 on both sides
        assert torch.equal(got, torch.zeros_like(got))
    else:  # -log p_S(teacher's argmax) > 0
        assert (got > 0).all()


@pytest.mark.parametrize("zero_outside_topk", [False, True])
@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_gradient_reaches_the_student_and_extreme_logits_stay_finite(kl_type, zero_outside_topk):
    # NeMo: test_distillation_loss_gradient_flow, test_distillation_loss_edge_cases
    gen = torch.Generator().manual_seed(4)
    teacher_logits = torch.randn(2, 4, 8, generator=gen)
    student_logits = torch.randn(2, 4, 8, generator=gen).requires_grad_(True)
    _per_token(student_logits, teacher_logits, 5, kl_type, zero_outside_topk).mean().backward()
    assert student_logits.grad is not None and student_logits.grad.abs().sum() > 0
    for fill in (0.0, 100.0, -100.0):
        got = _per_token(torch.full((2, 4, 8), fill), teacher_logits, 5, kl_type, zero_outside_topk)
        assert torch.isfinite(got).all(), fill


def test_every_kl_is_non_negative_with_renormalised_top_k():
    gen = torch.Generator().manual_seed(5)
    teacher_logits, student_logits = (
        torch.randn(4, 6, 10, generator=gen),
        torch.randn(4, 6, 10, generator=gen),
    )
    for kl_type in KL_TYPES:
        assert (_per_token(student_logits, teacher_logits, 6, kl_type, False) >= -1e-6).all(), kl_type


def test_unknown_kl_type_and_weight_outside_zero_one_are_refused():
    lp = torch.log_softmax(torch.zeros(1, 2), -1)
    with pytest.raises(ValueError, match="unknown distillation KL"):
        distillation_kl(lp, lp, "jensen")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"mixed_kl_weight must be in \[0, 1\]"):
        distillation_kl(lp, lp, "mixed", 1.5)
