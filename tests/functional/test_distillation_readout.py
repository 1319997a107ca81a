"""The distillation passes in every micro-batch layout: the teacher's top k and the student's loss read at the
teacher's tokens (``rlfleet.policy.logprobs.Readout``) give, packed, dynamic, in fixed rows and chunked over
the output layer, what the padded whole-logits computation gives, and what the closed form from the model's
full logits gives."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfleet.algorithms.distillation.kl import distillation_kl, needs_entropy, student_at_ids, teacher_topk
from rlfleet.algorithms.distillation.loss import DistillationLossFn
from rlfleet.algorithms.distillation.teacher import model_topk
from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.loss_math import Normalizer
from rlfleet.policy.microbatch import MicroBatching
from rlfleet.policy.rank import PolicyRank
from tests.functional.test_packing import LAYOUTS, PADDED, assert_same, gradients, make_batch, make_worker

K = 6
ALL_LAYOUTS = {
    **LAYOUTS,
    "chunked": replace(PADDED, logprob_chunk=5),
    "packed_chunked": replace(LAYOUTS["packed"], logprob_chunk=7),
}


@pytest.fixture(scope="module")
def student(tiny_model_dir: Path) -> PolicyRank:
    return make_worker(tiny_model_dir)


@pytest.fixture(scope="module")
def teacher(tiny_model_dir: Path) -> torch.nn.Module:
    """The tiny model with its weights perturbed: a teacher that disagrees with the student."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(2.0 * torch.randn(p.shape, generator=gen) * p.std().clamp(min=1e-3))
    return model.eval()


def with_teacher(batch: TrainBatch, teacher: torch.nn.Module) -> TrainBatch:
    logprobs, ids = model_topk(teacher, batch, PADDED, K)
    return batch.with_(teacher_topk_logprobs=logprobs, teacher_topk_ids=ids)


def test_teacher_top_k_is_the_full_logits_top_k_at_each_next_position(
    student: PolicyRank, teacher: torch.nn.Module
) -> None:
    batch = make_batch(student)
    logprobs, ids = model_topk(teacher, batch, PADDED, K)
    with torch.no_grad():
        logits = teacher(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    want_lp, want_ids = teacher_topk(logits[:, :-1], K)
    real = batch.attention_mask[:, 1:].bool()
    assert torch.equal(ids[:, 1:][real], want_ids[real])
    torch.testing.assert_close(logprobs[:, 1:][real], want_lp[real], rtol=0, atol=1e-5)
    assert not logprobs[:, 0].any() and not logprobs[batch.attention_mask == 0].any()


@pytest.mark.parametrize("layout", sorted(ALL_LAYOUTS))
def test_teacher_top_k_is_the_same_in_every_layout(
    student: PolicyRank, teacher: torch.nn.Module, layout: str
) -> None:
    batch = make_batch(student)
    want_lp, want_ids = model_topk(teacher, batch, PADDED, K)
    got_lp, got_ids = model_topk(teacher, batch, ALL_LAYOUTS[layout], K)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=2e-5)
    assert torch.equal(got_ids, want_ids)
    halves = [model_topk(teacher, batch, ALL_LAYOUTS[layout], K, num_shards=2, shard=s) for s in (0, 1)]
    assert torch.equal(torch.cat([h[1] for h in halves]), want_ids)


def _closed_form_loss(worker: PolicyRank, batch: TrainBatch, loss_fn: DistillationLossFn) -> torch.Tensor:
    """The distillation loss from the student's full logits, written out without the readout."""
    logits = worker.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert batch.teacher_topk_ids is not None and batch.teacher_topk_logprobs is not None
    ids, teacher = batch.teacher_topk_ids[:, 1:], batch.teacher_topk_logprobs[:, 1:]
    student, neg_entropy = student_at_ids(
        logits[:, :-1],
        ids,
        zero_outside_topk=loss_fn.zero_outside_topk,
        with_entropy=needs_entropy(loss_fn.kl_type, loss_fn.zero_outside_topk),
    )
    per_token = distillation_kl(student, teacher, loss_fn.kl_type, loss_fn.mixed_kl_weight, neg_entropy)
    mask = batch.response_mask[:, 1:]
    return (per_token * mask).sum() / mask.sum()


LOSSES = {
    "forward": DistillationLossFn("forward"),
    "reverse_zero_outside": DistillationLossFn("reverse", zero_outside_topk=True),
    "mixed": DistillationLossFn("mixed", 0.3),
    "mixed_zero_outside": DistillationLossFn("mixed", 0.3, zero_outside_topk=True),
}


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_student_loss_and_gradients_equal_the_closed_form_from_full_logits(
    student: PolicyRank, teacher: torch.nn.Module, loss: str
) -> None:
    loss_fn = LOSSES[loss]
    batch = with_teacher(make_batch(student), teacher)
    student.model.train()
    student.optimizer.zero_grad(set_to_none=True)
    _closed_form_loss(student, batch, loss_fn).backward()
    want = {n: p.grad.detach().clone() for n, p in student.model.named_parameters()}
    for name, layout in {"padded": PADDED, **ALL_LAYOUTS}.items():
        got, metrics = gradients(student, batch, loss_fn, layout)
        assert_same(got, want, rtol=1e-4, atol=1e-6)
        assert metrics["loss"] > 0 and 0 <= metrics["teacher_top1_agreement"] <= 1 + 1e-6, name
    _, halves = gradients(student, batch, loss_fn, LAYOUTS["packed"], num_shards=2)
    _, whole = gradients(student, batch, loss_fn, PADDED)
    assert halves["loss"] == pytest.approx(whole["loss"], rel=1e-5)


def test_a_student_equal_to_its_teacher_has_zero_loss_with_all_k(student: PolicyRank) -> None:
    batch = make_batch(student)
    vocabulary = student.model.config.vocab_size
    logprobs, ids = model_topk(student.model, batch, PADDED, vocabulary)
    batch = batch.with_(teacher_topk_logprobs=logprobs, teacher_topk_ids=ids)
    norm = Normalizer(float(batch.response_mask.sum()), float(len(batch)))
    for loss_fn in LOSSES.values():
        metrics = student._accumulate(batch, loss_fn, norm, [list(range(len(batch)))], PADDED, 1.0)
        assert metrics["loss"] == pytest.approx(0.0, abs=1e-5)
        assert metrics["teacher_top1_agreement"] == pytest.approx(1.0)


def test_the_loss_refuses_a_batch_without_the_teachers_top_k(student: PolicyRank) -> None:
    batch = make_batch(student)
    norm = Normalizer(1.0, 1.0)
    with pytest.raises(ValueError, match=r"needs batch\.teacher_topk_ids"):
        student._accumulate(batch, LOSSES["forward"], norm, [[0, 1]], MicroBatching(rows=2), 1.0)
