import math

import pytest
import torch

from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.loss_functions import ClippedPGLossFn
from rlfleet.policy.loss_math import Normalizer, aggregate, clipped_pg_loss, kl_k3, masked_mean


def test_kl_k3_by_hand_and_clamps():
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5)]])
    x = ref - logp  # [-ln2, ln2]
    expected = torch.exp(x) - 1 - x
    torch.testing.assert_close(kl_k3(logp, ref), expected)
    assert float(kl_k3(logp, ref)[0, 0]) == pytest.approx(0.5 - 1 + math.log(2), rel=1e-6)
    big = kl_k3(torch.tensor([[0.0]]), torch.tensor([[50.0]]), input_clamp=20.0, output_clamp=None)
    torch.testing.assert_close(big, torch.tensor([[math.exp(20.0) - 21.0]]))
    capped = kl_k3(torch.tensor([[0.0]]), torch.tensor([[50.0]]), input_clamp=20.0, output_clamp=10.0)
    assert float(capped) == 10.0
    assert torch.equal(kl_k3(logp, logp), torch.zeros_like(logp))


def test_clipped_pg_loss_hand_example():
    # ratios 1.5 and 0.5; eps 0.2; advantages +1 and -1
    prev = torch.zeros(2, 1)
    logp = torch.log(torch.tensor([[1.5], [0.5]]))
    adv = torch.tensor([[1.0], [-1.0]])
    loss, ratio = clipped_pg_loss(logp, prev, adv, 0.2, 0.2)
    torch.testing.assert_close(ratio, torch.tensor([[1.5], [0.5]]))
    # A=+1, r=1.5: max(-1.5, -1.2) = -1.2 ; A=-1, r=0.5: max(0.5, 0.8) = 0.8
    torch.testing.assert_close(loss, torch.tensor([[-1.2], [0.8]]))


def test_asymmetric_clip_and_dual_clip():
    prev = torch.zeros(1, 1)
    logp = torch.log(torch.tensor([[1.3]]))
    loss, _ = clipped_pg_loss(logp, prev, torch.tensor([[1.0]]), 0.2, 0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.28]]))
    # negative advantage, huge ratio: unclipped 5*1 = 5, dual clip c=3 caps at 3
    logp = torch.log(torch.tensor([[5.0]]))
    loss, _ = clipped_pg_loss(logp, prev, torch.tensor([[-1.0]]), 0.2, 0.2, dual_clip_c=3.0)
    torch.testing.assert_close(loss, torch.tensor([[3.0]]))


def _reference_loss(logp, prev, ref, adv, mask, eps, beta, token_level):
    """Straight float64 transcription of the formulas, token by token."""
    total, count, per_seq = 0.0, 0.0, []
    for i in range(len(logp)):
        s, n = 0.0, 0.0
        for t in range(len(logp[0])):
            if mask[i][t] == 0:
                continue
            r = math.exp(logp[i][t] - prev[i][t])
            clip = -adv[i] * min(max(r, 1 - eps), 1 + eps)
            x = min(max(ref[i][t] - logp[i][t], -20), 20)
            kl = min(max(math.exp(x) - 1 - x, -10), 10)
            value = max(-adv[i] * r, clip) + beta * kl
            s, n = s + value, n + 1
        total, count = total + s, count + n
        per_seq.append(s / n)
    return total / count if token_level else sum(per_seq) / len(per_seq)


def _random_batch(seed=0, b=4, t=7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    prev = logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    ref = logp + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = torch.zeros(b, t, dtype=torch.float64)
    for i, (s, e) in enumerate([(2, 7), (3, 5), (1, 6), (4, 7)]):
        mask[i, s:e] = 1
    return logp, prev, ref, adv, mask


def test_loss_function_matches_float64_reference_both_normalisations():
    logp, prev, ref, adv, mask = _random_batch()
    for token_level in (True, False):
        fn = ClippedPGLossFn(0.2, 0.2, None, 0.05, 20.0, 10.0, token_level, False)
        batch = TrainBatch(
            input_ids=torch.zeros(4, 7, dtype=torch.long),
            attention_mask=torch.ones(4, 7, dtype=torch.long),
            response_mask=mask,
            advantages=adv,
            prev_logprobs=prev,
            ref_logprobs=ref,
        )
        norm = Normalizer(num_tokens=float(mask.sum()), num_sequences=4.0)
        loss, metrics = fn(logp, batch, norm)
        expected = _reference_loss(
            logp.tolist(), prev.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.05, token_level
        )
        assert abs(float(loss) - expected) < 1e-12
        assert metrics["kl"] > 0


def test_masked_tokens_do_not_matter():
    logp, prev, ref, adv, mask = _random_batch(1)
    fn = ClippedPGLossFn(0.2, 0.2, None, 0.1, 20.0, 10.0, True, False)
    norm = Normalizer(float(mask.sum()), 4.0)

    def loss_with(lp):
        batch = TrainBatch(
            torch.zeros(4, 7, dtype=torch.long),
            torch.ones(4, 7, dtype=torch.long),
            mask,
            advantages=adv,
            prev_logprobs=prev,
            ref_logprobs=ref,
        )
        return float(fn(lp, batch, norm)[0])

    garbage = logp.clone()
    garbage[mask == 0] = 123.0
    assert loss_with(logp) == loss_with(garbage)


def test_aggregate_split_equals_whole():
    values = torch.randn(6, 5, dtype=torch.float64)
    mask = (torch.rand(6, 5) > 0.3).double()
    mask[:, 0] = 1
    norm = Normalizer(float(mask.sum()), 6.0)
    for token_level in (True, False):
        whole = aggregate(values, mask, norm, token_level)
        parts = sum(aggregate(values[i : i + 2], mask[i : i + 2], norm, token_level) for i in range(0, 6, 2))
        torch.testing.assert_close(whole, parts)
    torch.testing.assert_close(aggregate(values, mask, norm, True), masked_mean(values, mask))


def test_prev_from_training_forward_equals_a_detached_prev_in_loss_gradient_and_metrics():
    logp, _, ref, adv, mask = _random_batch(2)
    gen = logp + 0.01 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(3), dtype=logp.dtype)
    norm = Normalizer(float(mask.sum()), 4.0)
    results = []
    for reuse in (False, True):
        fn = ClippedPGLossFn(0.2, 0.2, None, 0.05, 20.0, 10.0, True, True, prev_from_training_forward=reuse)
        lp = logp.clone().requires_grad_(True)
        batch = TrainBatch(
            torch.zeros(4, 7, dtype=torch.long),
            torch.ones(4, 7, dtype=torch.long),
            mask,
            advantages=adv,
            prev_logprobs=None if reuse else logp.clone(),
            ref_logprobs=ref,
            generation_logprobs=gen,
        )
        loss, metrics = fn(lp, batch, norm)
        loss.backward()
        results.append((float(loss.detach()), lp.grad, metrics))
    (loss_a, grad_a, m_a), (loss_b, grad_b, m_b) = results
    assert loss_a == loss_b
    torch.testing.assert_close(grad_b, grad_a, rtol=0, atol=0)
    assert m_a == m_b
    assert m_b["ratio"] == pytest.approx(1.0)
    expected_error = float(((logp - gen).abs() * mask).sum() / mask.sum())
    assert m_b["gen_logprob_error"] == pytest.approx(expected_error, rel=1e-12)


def test_prev_from_training_forward_refuses_a_batch_that_also_carries_prev():
    logp, prev, ref, adv, mask = _random_batch()
    fn = ClippedPGLossFn(0.2, 0.2, None, 0.0, 20.0, 10.0, True, False, prev_from_training_forward=True)
    batch = TrainBatch(torch.zeros(4, 7, dtype=torch.long), torch.ones(4, 7, dtype=torch.long), mask)
    with pytest.raises(ValueError, match="one or the other"):
        fn(logp, batch.with_(advantages=adv, prev_logprobs=prev, ref_logprobs=ref), Normalizer(1.0, 4.0))
