"""GSPO, Dr.GRPO and the bounded importance-sampling corrections: hand-computed values and a float64
token-by-token reference, as for the plain clipped loss in test_loss.py."""

import math
from dataclasses import replace

import pytest
import torch

from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.importance_sampling import (
    icepop_weights,
    importance_weights,
    sequence_importance_weights,
    sequence_mask_weights,
    token_importance_weights,
    truncate_weights,
)
from rlfleet.policy.loss_functions import ClippedPGLossFn
from rlfleet.policy.loss_math import Normalizer, aggregate_max_length, gspo_loss, sequence_ratio

# ------------------------------------------------------------------------------------------- pure maths


def test_sequence_ratio_is_the_geometric_mean_of_the_response_token_ratios():
    prev = torch.zeros(2, 3)
    logp = torch.log(torch.tensor([[9.0, 2.0, 0.5], [4.0, 1.0, 1.0]]))
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # row 0: sqrt(2 * 0.5) = 1 (the prompt token's 9 ignored); row 1: the one token, 4
    torch.testing.assert_close(sequence_ratio(logp, prev, mask), torch.tensor([[1.0], [4.0]]))
    empty = torch.zeros(1, 3)
    torch.testing.assert_close(sequence_ratio(logp[:1], prev[:1], empty), torch.tensor([[1.0]]))


def test_gspo_loss_clips_the_sequence_ratio_by_hand():
    prev = torch.zeros(2, 2)
    # sequence ratios exp(mean log) = sqrt(1.21 * 1.0) = 1.1 and sqrt(0.64 * 1.0) = 0.8
    logp = torch.log(torch.tensor([[1.21, 1.0], [0.64, 1.0]]))
    mask = torch.ones(2, 2)
    adv = torch.tensor([[1.0], [-1.0]])
    loss, ratio = gspo_loss(logp, prev, adv, mask, 3e-4, 4e-4)
    torch.testing.assert_close(ratio, torch.tensor([[1.1, 1.1], [0.8, 0.8]]))
    # A=+1, s=1.1: max(-1.1, -1.0004) = -1.0004 ; A=-1, s=0.8: max(0.8, 0.9997) = 0.9997
    torch.testing.assert_close(loss, torch.tensor([[-1.0004, -1.0004], [0.9997, 0.9997]]))


def test_aggregate_max_length_by_hand_and_split_equals_whole():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    norm = Normalizer(3.0, 2.0)
    # (1 + 2 + 6) / (2 sequences * 10 tokens)
    assert float(aggregate_max_length(values, mask, norm, 10)) == pytest.approx(0.45, rel=1e-15)
    parts = sum(aggregate_max_length(values[i : i + 1], mask[i : i + 1], norm, 10) for i in range(2))
    torch.testing.assert_close(parts, aggregate_max_length(values, mask, norm, 10))


def test_importance_weights_by_hand():
    gen = torch.zeros(1, 4)
    prev = torch.log(torch.tensor([[0.25, 1.0, 3.0, 8.0]]))
    w = token_importance_weights(prev, gen)
    torch.testing.assert_close(w, torch.tensor([[0.25, 1.0, 3.0, 8.0]]))
    tis = truncate_weights(w, 2.0)
    torch.testing.assert_close(tis.weights, torch.tensor([[0.25, 1.0, 2.0, 2.0]]))
    torch.testing.assert_close(tis.out_of_band, torch.tensor([[0.0, 0.0, 1.0, 1.0]]))
    ice = icepop_weights(w, 0.5, 5.0)
    torch.testing.assert_close(ice.weights, torch.tensor([[0.0, 1.0, 3.0, 0.0]]))
    torch.testing.assert_close(ice.out_of_band, torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(sequence_importance_weights(prev, gen, mask), torch.tensor([[3.0]]))
    # geometric mean over the response tokens sqrt(1 * 3) = 1.73: masked by [0.5, 1.5], kept by [0.5, 2]
    masked = sequence_mask_weights(w, prev, gen, mask, 0.5, 1.5)
    torch.testing.assert_close(masked.weights, torch.zeros(1, 4))
    torch.testing.assert_close(masked.out_of_band, torch.tensor([1.0]))
    kept = sequence_mask_weights(w, prev, gen, mask, 0.5, 2.0)
    torch.testing.assert_close(kept.weights, w)


def test_importance_weights_non_finite_become_zero_and_bad_settings_raise():
    prev, gen = torch.tensor([[0.0, 1000.0]]), torch.tensor([[0.0, 0.0]])
    torch.testing.assert_close(token_importance_weights(prev, gen), torch.tensor([[1.0, 0.0]]))
    mask = torch.ones(1, 2)
    with pytest.raises(ValueError, match="bounds"):
        importance_weights(
            prev, gen, mask, sequence_level=False, truncation="icepop", ratio_max=2.0, ratio_min=None
        )
    with pytest.raises(ValueError, match="cannot combine"):
        importance_weights(
            prev, gen, mask, sequence_level=True, truncation="seq-mask-tis", ratio_max=2.0, ratio_min=0.5
        )


# ------------------------------------------------------------------------------- loss vs float64 reference


def _batch(seed=0, b=4, t=7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    prev = logp + 0.05 * torch.randn(b, t, generator=g, dtype=torch.float64)
    ref = logp + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)
    gen = prev + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = torch.zeros(b, t, dtype=torch.float64)
    for i, (s, e) in enumerate([(2, 7), (3, 5), (1, 6), (4, 7)]):
        mask[i, s:e] = 1
    batch = TrainBatch(
        torch.zeros(b, t, dtype=torch.long),
        torch.ones(b, t, dtype=torch.long),
        mask,
        advantages=adv,
        prev_logprobs=prev,
        ref_logprobs=ref,
        generation_logprobs=gen,
    )
    return logp, batch


def _kl(logp, ref):
    x = min(max(ref - logp, -20), 20)
    return min(max(math.exp(x) - 1 - x, -10), 10)


def _clip(r, a, lo, hi):
    return max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))


def _reference(
    logp, b: TrainBatch, *, lo, hi, beta, mode, gspo=False, is_type=None, is_lo=None, is_hi=None, max_len=None
):
    """Float64 transcription, token by token: per-sequence lists, then the aggregation ``mode``."""
    lp, prev, ref, gen = (x.tolist() for x in (logp, b.prev_logprobs, b.ref_logprobs, b.generation_logprobs))
    adv, mask = b.advantages.tolist(), b.response_mask.tolist()
    seqs = []
    for i in range(len(lp)):
        toks = [t for t in range(len(lp[0])) if mask[i][t]]
        s_ratio = math.exp(sum(lp[i][t] - prev[i][t] for t in toks) / len(toks))
        geo = math.exp(sum(prev[i][t] - gen[i][t] for t in toks) / len(toks))
        values = []
        for t in toks:
            r = s_ratio if gspo else math.exp(lp[i][t] - prev[i][t])
            w = 1.0
            if is_type is not None:
                w = math.exp(prev[i][t] - gen[i][t])
                if is_type == "tis":
                    w = min(max(w, is_lo or 0.0), is_hi)
                elif is_type == "icepop":
                    w = w if is_lo <= w <= is_hi else 0.0
                elif is_type == "seq-mask-tis":
                    w = w if is_lo <= geo <= is_hi else 0.0
            values.append(w * _clip(r, adv[i], lo, hi) + beta * _kl(lp[i][t], ref[i][t]))
        seqs.append(values)
    if mode == "token":
        return sum(map(sum, seqs)) / sum(map(len, seqs))
    if mode == "sequence":
        return sum(sum(v) / len(v) for v in seqs) / len(seqs)
    return sum(map(sum, seqs)) / (len(seqs) * max_len)  # Dr.GRPO


def _run(fn, logp, batch):
    norm = Normalizer(float(batch.response_mask.sum()), float(len(batch)))
    loss, metrics = fn(logp, batch, norm)
    return float(loss), metrics


def test_gspo_matches_the_float64_reference():
    logp, batch = _batch(1)
    fn = ClippedPGLossFn(0.05, 0.08, None, 0.05, 20.0, 10.0, False, False, sequence_level_ratios=True)
    loss, metrics = _run(fn, logp, batch)
    assert loss == pytest.approx(
        _reference(logp, batch, lo=0.05, hi=0.08, beta=0.05, mode="sequence", gspo=True), rel=1e-12
    )
    assert 0.0 <= metrics["clip_fraction"] <= 1.0


def test_dr_grpo_constant_normaliser_matches_the_float64_reference():
    logp, batch = _batch(2)
    fn = ClippedPGLossFn(0.2, 0.2, None, 0.05, 20.0, 10.0, False, False, max_length=12)
    loss, _ = _run(fn, logp, batch)
    expected = _reference(logp, batch, lo=0.2, hi=0.2, beta=0.05, mode="max_length", max_len=12)
    assert loss == pytest.approx(expected, rel=1e-12)


def test_dr_grpo_is_micro_batch_invariant_in_loss_and_gradient():
    logp, batch = _batch(3)
    fn = ClippedPGLossFn(0.2, 0.2, None, 0.05, 20.0, 10.0, False, False, max_length=12)
    norm = Normalizer(float(batch.response_mask.sum()), float(len(batch)))
    whole = logp.clone().requires_grad_(True)
    fn(whole, batch, norm)[0].backward()
    parts = logp.clone().requires_grad_(True)
    for s in (0, 2):
        fn(parts[s : s + 2], batch.select(s, s + 2), norm)[0].backward()
    torch.testing.assert_close(parts.grad, whole.grad)


@pytest.mark.parametrize(
    ("kind", "low", "high"),
    [("tis", None, 1.2), ("tis", 0.9, 1.2), ("icepop", 0.8, 1.3), ("seq-mask-tis", 0.7, 1.5)],
)
def test_bounded_importance_sampling_matches_the_float64_reference(kind, low, high):
    logp, batch = _batch(4)
    fn = ClippedPGLossFn(
        0.2,
        0.28,
        None,
        0.05,
        20.0,
        10.0,
        True,
        True,
        truncation=kind,
        truncation_ratio_max=high,
        truncation_ratio_min=low,
    )
    loss, metrics = _run(fn, logp, batch)
    expected = _reference(
        logp, batch, lo=0.2, hi=0.28, beta=0.05, mode="token", is_type=kind, is_lo=low, is_hi=high
    )
    assert loss == pytest.approx(expected, rel=1e-12)
    # metrics: the share the bound hit and the mean weight, recomputed directly
    mask = batch.response_mask.bool()
    w = torch.exp(batch.prev_logprobs - batch.generation_logprobs)
    if kind == "seq-mask-tis":
        log_w = (batch.prev_logprobs - batch.generation_logprobs) * batch.response_mask
        geo = torch.exp(log_w.sum(1) / batch.response_mask.sum(1))
        hit = ((geo < low) | (geo > high)).double()
        assert metrics["is_oob_ratio"] == pytest.approx(float(hit.mean()), rel=1e-12)
        applied = w * (1 - hit).unsqueeze(1)
    elif kind == "icepop":
        inside = (w >= low) & (w <= high)
        assert metrics["is_oob_ratio"] == pytest.approx(float((~inside)[mask].double().mean()), rel=1e-12)
        applied = torch.where(inside, w, 0.0)
    else:
        floor = low or 0.0
        hit = (w > high) | (w < floor)
        assert metrics["is_oob_ratio"] == pytest.approx(float(hit[mask].double().mean()), rel=1e-12)
        applied = w.clamp(min=floor, max=high)
    assert metrics["sampling_importance_ratio"] == pytest.approx(float(applied[mask].mean()), rel=1e-12)
    assert 0.0 < metrics["is_oob_ratio"] < 1.0  # the fixture's mismatch is large enough to hit the bound


def test_untruncated_correction_still_reports_the_mean_weight_only():
    logp, batch = _batch(5)
    fn = ClippedPGLossFn(0.2, 0.2, None, 0.0, 20.0, 10.0, True, True)
    loss, metrics = _run(fn, logp, batch)
    assert loss == pytest.approx(
        _reference(logp, batch, lo=0.2, hi=0.2, beta=0.0, mode="token", is_type="tis", is_hi=math.inf),
        rel=1e-12,
    )
    assert "is_oob_ratio" not in metrics and metrics["sampling_importance_ratio"] > 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"truncation": "tis", "truncation_ratio_max": 2.0}, "which is off"),
        ({"sequence_level_ratios": True}, "token_level must be False"),
        ({"max_length": 64}, "token_level must be False"),
    ],
)
def test_incoherent_loss_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClippedPGLossFn(0.2, 0.2, None, 0.0, 20.0, 10.0, True, False, **kwargs)


def test_tis_floor_clamps_from_below_as_nemo_rl() -> None:
    """``tis`` with ``ratio_min``: weights are clamped to ``[min, max]`` (NeMo RL's lower bound; 0 unset)."""
    w = torch.tensor([[0.1, 0.6, 1.0, 3.0]])
    floored = truncate_weights(w, 2.0, 0.5)
    torch.testing.assert_close(floored.weights, torch.tensor([[0.5, 0.6, 1.0, 2.0]]))
    torch.testing.assert_close(floored.out_of_band, torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    unset = truncate_weights(w, 2.0)
    torch.testing.assert_close(unset.weights, torch.tensor([[0.1, 0.6, 1.0, 2.0]]))


def test_the_loss_honours_the_tis_floor_and_refuses_orphan_bounds() -> None:
    """The loss reaches the floor (the weights of low-ratio tokens are raised to it), and bounds without a
    truncation type are refused rather than ignored."""
    prev = torch.tensor([[-1.0, -1.0]])
    gen = torch.tensor([[0.0, -1.0]])  # w = [e^-1 ~ 0.37, 1]
    batch = TrainBatch(
        input_ids=torch.zeros(1, 2, dtype=torch.long),
        attention_mask=torch.ones(1, 2, dtype=torch.long),
        response_mask=torch.ones(1, 2),
        advantages=torch.tensor([1.0]),
        prev_logprobs=prev,
        generation_logprobs=gen,
    )
    norm = Normalizer(num_tokens=2.0, num_sequences=1.0)

    def loss(low: float | None) -> float:
        fn = ClippedPGLossFn(0.2, 0.2, None, 0.0, 20.0, 10.0, True, True, truncation="tis")
        fn = replace(fn, truncation_ratio_max=2.0, truncation_ratio_min=low)
        return float(fn(prev.clone(), batch, norm)[0])

    assert loss(None) == pytest.approx(-(math.exp(-1.0) + 1.0) / 2)
    assert loss(0.5) == pytest.approx(-(0.5 + 1.0) / 2)
    with pytest.raises(ValueError, match="without a truncation type"):
        ClippedPGLossFn(0.2, 0.2, None, 0.0, 20.0, 10.0, True, True, truncation_ratio_min=0.5)
