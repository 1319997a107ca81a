"""Parity with NVIDIA NeMo RL's own unit tests of the GRPO maths.

Each test takes the inputs of one NeMo RL test case, runs rlfleet's function on them, and checks NeMo RL's
expected value, recomputed here from NeMo RL's formula where NeMo's test does so. A change in rlfleet that
drifts from NeMo RL fails here. Peer files (github.com/NVIDIA-NeMo/RL):

- ``tests/unit/algorithms/test_loss_functions.py`` (``nemo_rl/algorithms/loss/loss_functions.py``,
  ``nemo_rl/algorithms/utils.py::calculate_kl`` / ``masked_mean``)
- ``tests/unit/algorithms/test_utils.py`` (``calculate_baseline_and_std_per_prompt``)
- ``nemo_rl/algorithms/advantage_estimator.py::GRPOAdvantageEstimator.compute_advantage``

Translating the inputs:

- NeMo's logprobs are next-token ``[B, T-1]`` tensors with ``token_mask[:, 1:]``; rlfleet's are aligned with
  ``response_mask``, so the NeMo test's masked values (its ``*_masked`` tensors) are used as they are, with an
  all-ones response mask (``token_mask * sample_mask`` where a sample mask is involved).
- ``global_valid_toks`` / ``global_valid_seqs`` become ``Normalizer(num_tokens, num_sequences)``.
- rlfleet's advantages are one per sequence; NeMo's are per token, and most NeMo cases use ``[1, -1, 2]``
  within one sequence. Two exact re-expressions are used:
  ``_token_rows``: for token-level losses every NeMo token becomes its own length-1 sequence (the token-level
  mean over the batch is unchanged, and the ratio and importance weight of a token depend only on that
  token); ``_sequence_copies``: for sequence-level ratios (GSPO) each NeMo sequence of ``n`` tokens is
  repeated ``n`` times, copy ``k`` carrying token ``k``'s advantage (the sequence ratio and sequence weight
  are the same for every copy, so the mean over copies of ``f(A_k, r)`` is NeMo's per-sequence mean
  over tokens).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlfleet.algorithms.grpo.advantages import baseline_and_std, group_advantages
from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.logprobs import logprobs_from_logits
from rlfleet.policy.loss_functions import ClippedPGLossFn, NLLLossFn
from rlfleet.policy.loss_math import KLType, Normalizer, kl_estimate, kl_gradient_weights, masked_mean

# the logprobs most NeMo clipped-loss cases use: ratios exp(curr - prev) = [0.5, 1.0, 1.5] against prev = -1
CURR = torch.tensor([[-1.69315, -1.0, -0.59453]])
PREV = torch.tensor([[-1.0, -1.0, -1.0]])
ADV = torch.tensor([[1.0, -1.0, 2.0]])
GEN = torch.tensor([[-0.5, -1.5, -0.8]])
REF = torch.tensor([[-1.0, -1.0, -1.0]])


def _loss_fn(**overrides: object) -> ClippedPGLossFn:
    """rlfleet's loss configured like NeMo RL's ``ClippedPGLossConfig()`` defaults, with overrides."""
    cfg: dict[str, object] = {
        "eps_low": 0.2,  # ratio_clip_min
        "eps_high": 0.2,  # ratio_clip_max
        "dual_clip_c": None,  # ratio_clip_c
        "kl_penalty": 0.01,  # reference_policy_kl_penalty
        "kl_type": "k3",  # reference_policy_kl_type
        "kl_input_clamp": 20.0,
        "kl_output_clamp": 10.0,
        "token_level": True,  # token_level_loss
        "importance_sampling_correction": False,
    }
    cfg.update(overrides)
    return ClippedPGLossFn(**cfg)  # type: ignore[arg-type]


def _batch(
    mask: torch.Tensor,
    advantages: torch.Tensor | None = None,
    prev: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
    gen: torch.Tensor | None = None,
) -> TrainBatch:
    rows, cols = mask.shape
    return TrainBatch(
        input_ids=torch.zeros(rows, cols, dtype=torch.long),
        attention_mask=torch.ones(rows, cols, dtype=torch.long),
        response_mask=mask.float(),
        advantages=advantages,
        prev_logprobs=prev,
        ref_logprobs=ref,
        generation_logprobs=gen,
    )


def _token_rows(
    curr: torch.Tensor,
    adv: torch.Tensor,
    prev: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
    gen: torch.Tensor | None = None,
) -> tuple[torch.Tensor, TrainBatch, Normalizer]:
    """NeMo's all-valid ``[B, n]`` token values as ``B * n`` one-token sequences, advantage per token."""

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.reshape(-1, 1)

    count = curr.numel()
    batch = _batch(torch.ones(count, 1), adv.reshape(-1), rows(prev), rows(ref), rows(gen))
    return curr.reshape(-1, 1), batch, Normalizer(num_tokens=count, num_sequences=count)


def _sequence_copies(
    curr: torch.Tensor,
    adv: torch.Tensor,
    prev: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
    gen: torch.Tensor | None = None,
) -> tuple[torch.Tensor, TrainBatch, Normalizer]:
    """Each NeMo sequence of ``n`` all-valid tokens repeated ``n`` times, copy ``k`` with advantage ``k``."""
    seqs, n = curr.shape

    def copies(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.repeat_interleave(n, dim=0)

    batch = _batch(torch.ones(seqs * n, n), adv.reshape(-1), copies(prev), copies(ref), copies(gen))
    out = copies(curr)
    assert out is not None
    return out, batch, Normalizer(num_tokens=seqs * n * n, num_sequences=seqs * n)


def _nemo_clip_loss(
    curr: torch.Tensor,
    prev: torch.Tensor,
    adv: torch.Tensor,
    clip_min: float = 0.2,
    clip_max: float = 0.2,
    clip_c: float | None = None,
    sequence_level: bool = False,
) -> torch.Tensor:
    """NeMo RL ``ClippedPGLossFn``'s per-token ``clip_loss`` on all-valid ``[B, n]`` tensors (its formula)."""
    log_ratios = curr - prev
    if sequence_level:
        ratios = log_ratios.mean(dim=-1, keepdim=True).exp().expand_as(adv)
    else:
        ratios = log_ratios.exp()
    ratios_clamped = ratios.clamp(1.0 - clip_min, 1.0 + clip_max)
    loss = torch.maximum(-adv * ratios, -adv * ratios_clamped)
    if clip_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * clip_c), loss)
    return loss


def _k3(logprobs: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    r = ref - logprobs
    return torch.exp(r) - r - 1


# ---------------------------------------------------------------------------------------------------------
# tests/unit/algorithms/test_loss_functions.py
# ---------------------------------------------------------------------------------------------------------


def test_nll_loss_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::test_nll_loss.

    Same logits, input ids ``[0, 1, 2, 3]`` and token mask ``[0, 0, 1, 1]``; rlfleet's logprobs come from
    ``logprobs_from_logits`` (aligned with the mask). NeMo's ``num_unmasked_tokens`` metric has no rlfleet
    counterpart and is not checked.
    """
    input_ids = torch.arange(4).unsqueeze(0)
    batch = TrainBatch(input_ids, torch.ones_like(input_ids), torch.tensor([[0.0, 0.0, 1.0, 1.0]]))
    norm = Normalizer(num_tokens=2, num_sequences=1)

    right = torch.zeros(1, 4, 8)
    for t in range(3):
        right[0, t, t + 1] = 999.0  # the next token, predicted with certainty
    loss, _ = NLLLossFn()(logprobs_from_logits(right, input_ids, 1.0), batch, norm)
    torch.testing.assert_close(loss, torch.tensor(0.0))

    wrong = torch.zeros(1, 4, 8)
    for t in range(3):
        wrong[0, t, t] = 999.0  # the current token instead: the label gets logprob -999
    loss, _ = NLLLossFn()(logprobs_from_logits(wrong, input_ids, 1.0), batch, norm)
    torch.testing.assert_close(loss, torch.tensor(999.0))


def test_clipped_pg_loss_ppo_clipping_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::test_clipped_pg_loss_ppo_clipping.

    Ratios ``[0.5, 1.0, 1.5]``, advantages ``[1, -1, 2]`` (per token: ``_token_rows``), no KL.
    """
    max_loss = _nemo_clip_loss(CURR, PREV, ADV)
    torch.testing.assert_close(max_loss, torch.tensor([[-0.5, 1.0, -2.4]]), rtol=1e-3, atol=1e-4)
    expected = max_loss.mean()
    torch.testing.assert_close(expected, torch.tensor(-0.6333), rtol=1e-3, atol=1e-4)

    logprobs, batch, norm = _token_rows(CURR, ADV, prev=PREV, ref=REF)
    loss, metrics = _loss_fn(kl_penalty=0.0)(logprobs, batch, norm)
    torch.testing.assert_close(loss, expected)
    assert metrics["clip_fraction"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_calculate_kl_matches_nemo(kl_type: KLType) -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::test_calculate_kl.

    rlfleet's ``kl_estimate`` is NeMo's ``calculate_kl``: unclamped, and clamped (input 20, output 10).
    """
    logprobs = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-0.0, -15.0, -30.0]])
    unclamped = {
        "k1": [[-1.0, 14.0, 29.0]],
        "k2": [[0.5, 98.0, 420.5]],
        "k3": [[0.7183, 13.0, 28.0]],
    }
    clamped = {
        "k1": [[-1.0, 10.0, 10.0]],
        "k2": [[0.5, 10.0, 10.0]],
        "k3": [[0.7183, 10.0, 10.0]],
    }
    kl = kl_estimate(logprobs, ref, kl_type, input_clamp=None, output_clamp=None)
    torch.testing.assert_close(kl, torch.tensor(unclamped[kl_type]), rtol=1e-3, atol=0.0)
    kl = kl_estimate(logprobs, ref, kl_type, input_clamp=20.0, output_clamp=10.0)
    torch.testing.assert_close(kl, torch.tensor(clamped[kl_type]), rtol=1e-3, atol=0.0)


def test_calculate_kl_detaches_importance_sampling_when_input_clamped_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::
    test_calculate_kl_detaches_importance_sampling_when_input_clamped.

    The weights are rlfleet's ``kl_gradient_weights(logprobs, "k3")``, which is NeMo's
    ``exp(logprobs - logprobs.detach())`` (also checked here).
    """
    logprobs = torch.tensor([[-3.0, -1.0]], requires_grad=True)
    weights = kl_gradient_weights(logprobs, "k3")
    nemo_weights = torch.exp(logprobs - logprobs.detach())
    torch.testing.assert_close(weights.detach(), nemo_weights.detach())

    kl = kl_estimate(
        logprobs, torch.zeros_like(logprobs), "k3", input_clamp=2.0, output_clamp=None, weights=weights
    )
    torch.testing.assert_close(kl.detach(), torch.tensor([[4.389056, 0.7182818]]))
    kl.sum().backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -1.0]]), atol=1e-6, rtol=1e-6)


def test_calculate_kl_output_clamp_includes_importance_sampling_weight_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::
    test_calculate_kl_output_clamp_includes_importance_sampling_weight.
    """
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    weights = 100.0 * torch.exp(logprobs - logprobs.detach())
    kl = kl_estimate(
        logprobs, torch.zeros_like(logprobs), "k3", input_clamp=None, output_clamp=1.0, weights=weights
    )
    torch.testing.assert_close(kl.detach(), torch.tensor([[1.0]]))
    kl.sum().backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.zeros_like(logprobs), atol=1e-6, rtol=1e-6)


def test_clipped_pg_loss_kl_penalty_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::test_clipped_pg_loss_kl_penalty.

    Zero advantages (one sequence), beta 0.1: loss = 0.1 * mean(k3) = 0.0362. Also checks rlfleet's ``kl``
    metric against NeMo's ``kl_penalty`` metric (the unscaled token mean, 0.362).
    """
    curr = torch.tensor([[0.0, -1.0, -2.0]])
    ref = torch.tensor([[-1.0, -1.0, -1.0]])
    prev = torch.zeros(1, 3)
    kl_per_token = _k3(curr, ref)
    torch.testing.assert_close(kl_per_token, torch.tensor([[0.368, 0.0, 0.718]]), rtol=1e-3, atol=1e-4)
    expected_kl_mean = kl_per_token.mean()
    expected = 0.1 * expected_kl_mean
    torch.testing.assert_close(expected, torch.tensor(0.0362), rtol=1e-3, atol=1e-5)

    batch = _batch(torch.ones(1, 3), torch.zeros(1), prev=prev, ref=ref)
    loss, metrics = _loss_fn(kl_penalty=0.1)(curr, batch, Normalizer(num_tokens=3, num_sequences=1))
    torch.testing.assert_close(loss, expected)
    assert metrics["kl"] == pytest.approx(float(expected_kl_mean), rel=1e-6)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
@pytest.mark.parametrize("use_on_policy_kl_approximation", [False, True])
def test_clipped_pg_loss_kl_gradient_includes_sampling_term_matches_nemo(
    use_on_policy_kl_approximation: bool, kl_type: KLType
) -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::
    test_clipped_pg_loss_kl_gradient_includes_sampling_term (both parametrisations).

    NeMo's case is k3: grad(loss(beta) - loss(0)) = beta * w * (kl + dkl/dlogp) / n, with w = 1 (value)
    or exp(curr - gen) (on-policy approximation), w carrying the gradient. NeMo weights k1 and k2 the same
    way, so its formula gives the k1 case here too (dk1/dlogp = 1). k2 is rlfleet's documented departure
    (``kl_gradient_weights``): its weight is detached because k2's own gradient already is that of
    KL(pi || ref), so the expected gradient is beta * w * dk2/dlogp / n only (dk2/dlogp = -(ref - curr)).
    Per-token advantages ``[0.4, -0.2]`` via ``_token_rows`` (they cancel in the difference anyway).
    """
    curr = torch.tensor([[-1.2, -0.7]])
    prev = torch.tensor([[-1.0, -0.8]])
    gen = torch.tensor([[-1.5, -0.4]])
    ref = torch.tensor([[-0.9, -1.1]])
    adv = torch.tensor([[0.4, -0.2]])
    beta = 0.3

    def gradient(kl_penalty: float) -> torch.Tensor:
        logprobs, batch, norm = _token_rows(curr, adv, prev=prev, ref=ref, gen=gen)
        logprobs = logprobs.clone().requires_grad_(True)
        loss_fn = _loss_fn(
            kl_penalty=kl_penalty,
            kl_type=kl_type,
            use_on_policy_kl_approximation=use_on_policy_kl_approximation,
        )
        loss, _ = loss_fn(logprobs, batch, norm)
        loss.backward()
        assert logprobs.grad is not None
        return logprobs.grad.reshape(curr.shape)

    actual = gradient(beta) - gradient(0.0)
    x = ref - curr
    kl, dkl = {
        "k1": (-x, torch.ones_like(x)),
        "k2": (x.square() / 2, -x),
        "k3": (torch.exp(x) - 1 - x, 1 - torch.exp(x)),
    }[kl_type]
    weight = torch.exp(curr - gen) if use_on_policy_kl_approximation else torch.ones_like(curr)
    if kl_type == "k2":
        expected = beta * weight * dkl / curr.numel()
    else:
        expected = beta * weight * (kl + dkl) / curr.numel()
    torch.testing.assert_close(actual, expected)


def test_clipped_pg_loss_masking_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::test_clipped_pg_loss_masking.

    Random logprobs, beta 0.1, B=2 x 3 response tokens. Masking one more token changes the loss; with
    NeMo's sample mask ``[1, 0]`` (multiplied into rlfleet's response mask) the loss equals that of sample 0
    alone. Advantages are per sample (NeMo draws them per token; the masking properties do not depend on it).
    """
    gen = torch.Generator().manual_seed(0)
    curr = -torch.rand(2, 3, generator=gen) - 0.5
    prev = curr + 0.1 * torch.randn(2, 3, generator=gen)
    ref = curr + 0.1 * torch.randn(2, 3, generator=gen)
    adv = torch.randn(2, generator=gen) + 1.0
    loss_fn = _loss_fn(kl_penalty=0.1)

    def loss_with(mask: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        batch = _batch(mask[rows], adv[rows], prev=prev[rows], ref=ref[rows])
        norm = Normalizer(
            num_tokens=float(mask[rows].sum()), num_sequences=float((mask[rows].sum(1) > 0).sum())
        )
        loss, _ = loss_fn(curr[rows], batch, norm)
        return loss

    default = loss_with(torch.ones(2, 3))
    token_masked = torch.ones(2, 3)
    token_masked[0, 0] = 0.0
    assert not torch.isclose(default, loss_with(token_masked), atol=1e-4)

    sample_mask = torch.tensor([1.0, 0.0])
    sample_masked = loss_with(torch.ones(2, 3) * sample_mask.unsqueeze(-1))
    torch.testing.assert_close(sample_masked, loss_with(torch.ones(2, 3), slice(0, 1)))


def test_clipped_pg_loss_zero_mask_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::test_clipped_pg_loss_zero_mask.

    Beta 0.1, every token masked (global tokens 0, sequences 1): the loss is exactly 0.
    """
    gen = torch.Generator().manual_seed(1)
    curr = -torch.rand(1, 3, generator=gen)
    batch = _batch(torch.zeros(1, 3), torch.ones(1), prev=torch.zeros(1, 3), ref=torch.zeros(1, 3))
    loss, _ = _loss_fn(kl_penalty=0.1)(curr, batch, Normalizer(num_tokens=0, num_sequences=1))
    torch.testing.assert_close(loss, torch.tensor(0.0))


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_clipped_pg_loss_on_policy_kl_importance_sampling_matches_nemo(beta: float) -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::
    test_clipped_pg_loss_on_policy_kl_importance_sampling.

    Importance-sampling correction and on-policy KL approximation on; per-token advantages via
    ``_token_rows``. NeMo's case sets beta = 0 (expected loss = the weighted actor loss, -0.2065); beta 0.1
    also checks the weighted-KL half of NeMo's hand computation (mean of exp(curr - gen) * k3 = 0.060543).
    """
    actor_weights = torch.exp(PREV - GEN)
    torch.testing.assert_close(actor_weights, torch.tensor([[0.6065, 1.6487, 0.8187]]), rtol=1e-3, atol=0.0)
    expected_actor = (actor_weights * _nemo_clip_loss(CURR, PREV, ADV)).mean()
    torch.testing.assert_close(expected_actor, torch.tensor(-0.2065), rtol=1e-3, atol=1e-4)
    kl_weights = torch.exp(CURR - GEN)
    weighted_kl = kl_weights * _k3(CURR, REF)
    torch.testing.assert_close(weighted_kl, torch.tensor([[0.09308, 0.0, 0.08855]]), rtol=1e-3, atol=1e-5)
    expected = expected_actor + beta * weighted_kl.mean()

    logprobs, batch, norm = _token_rows(CURR, ADV, prev=PREV, ref=REF, gen=GEN)
    loss_fn = _loss_fn(
        kl_penalty=beta, importance_sampling_correction=True, use_on_policy_kl_approximation=True
    )
    loss, _ = loss_fn(logprobs, batch, norm)
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("sequence_level_importance_ratios", [True, False])
def test_clipped_pg_loss_on_policy_truncated_importance_sampling_matches_nemo(
    sequence_level_importance_ratios: bool,
) -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::
    test_clipped_pg_loss_on_policy_truncated_importance_sampling (both parametrisations).

    TIS with cap 0.8. Token level: per-token weights, ``_token_rows``. Sequence level (NeMo's
    ``sequence_level_importance_ratios`` + ``token_level_loss=False`` = rlfleet's ``sequence_level_ratios``):
    GSPO ratio and one weight exp(sum(prev - gen)) per sequence, per-token advantages via
    ``_sequence_copies``.
    """
    clip_loss = _nemo_clip_loss(CURR, PREV, ADV, sequence_level=sequence_level_importance_ratios)
    if sequence_level_importance_ratios:
        weights = torch.exp((PREV - GEN).sum(dim=-1, keepdim=True))
        anchor = -0.4846
    else:
        weights = torch.exp(PREV - GEN)
        anchor = -0.4744
    expected = (weights.clamp(max=0.8) * clip_loss).mean()
    torch.testing.assert_close(expected, torch.tensor(anchor), rtol=1e-3, atol=1e-4)

    loss_fn = _loss_fn(
        kl_penalty=0.0,
        importance_sampling_correction=True,
        truncation="tis",
        truncation_ratio_max=0.8,
        sequence_level_ratios=sequence_level_importance_ratios,
        token_level=not sequence_level_importance_ratios,
    )
    split = _sequence_copies if sequence_level_importance_ratios else _token_rows
    logprobs, batch, norm = split(CURR, ADV, prev=PREV, ref=REF, gen=GEN)
    loss, _ = loss_fn(logprobs, batch, norm)
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-3)


def test_clipped_pg_loss_icepop_importance_sampling_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::
    test_clipped_pg_loss_icepop_importance_sampling.

    ICE-POP band [0.5, 5], on-policy (curr = prev), weights exp([-0.5, 2.5, -0.2]): the middle token
    (12.18 > 5) is dropped. Per-token advantages via ``_token_rows``. Also checks ``is_oob_ratio`` (1/3),
    which NeMo's loss reports for this case.
    """
    prev = PREV
    gen = torch.tensor([[-0.5, -3.5, -0.8]])
    weights = torch.exp(prev - gen)
    kept = (weights >= 0.5) & (weights <= 5.0)
    expected = (torch.where(kept, weights, torch.zeros_like(weights)) * -ADV).mean()

    loss_fn = _loss_fn(
        kl_penalty=0.0,
        importance_sampling_correction=True,
        truncation="icepop",
        truncation_ratio_max=5.0,
        truncation_ratio_min=0.5,
    )
    logprobs, batch, norm = _token_rows(prev, ADV, prev=prev, gen=gen)
    loss, metrics = loss_fn(logprobs, batch, norm)
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-3)
    assert metrics["is_oob_ratio"] == pytest.approx(1 / 3)


def test_clipped_pg_loss_reports_is_oob_ratio_tis_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::
    test_clipped_pg_loss_reports_is_oob_ratio_tis.

    TIS cap 2, weights exp(prev - gen) = [1, 3, 0.5]: one token of three is truncated.
    """
    batch = _batch(
        torch.ones(1, 3),
        torch.ones(1),
        prev=torch.log(torch.tensor([[1.0, 3.0, 0.5]])),
        gen=torch.zeros(1, 3),
    )
    loss_fn = _loss_fn(
        kl_penalty=0.0, importance_sampling_correction=True, truncation="tis", truncation_ratio_max=2.0
    )
    _, metrics = loss_fn(torch.zeros(1, 3), batch, Normalizer(num_tokens=3, num_sequences=1))
    assert metrics["is_oob_ratio"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("tis_type", ["tis", "icepop", "seq-mask-tis"])
def test_clipped_pg_loss_rejects_tis_min_above_max_matches_nemo(tis_type: str) -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::
    test_clipped_pg_loss_rejects_tis_min_above_max.

    Bounds max 1.0 < min 2.0 are rejected. NeMo rejects them when the loss is built (AssertionError);
    rlfleet's ``ClippedPGLossFn`` accepts them and ``importance_weights`` raises ValueError at the first
    call, so both steps are inside the ``raises`` block.
    """
    batch = _batch(torch.ones(1, 3), torch.ones(1), prev=torch.zeros(1, 3), gen=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="min <= max"):
        loss_fn = _loss_fn(
            kl_penalty=0.0,
            importance_sampling_correction=True,
            truncation=tis_type,
            truncation_ratio_max=1.0,
            truncation_ratio_min=2.0,
        )
        loss_fn(torch.zeros(1, 3), batch, Normalizer(num_tokens=3, num_sequences=1))


@pytest.mark.parametrize(
    ("tis_min", "expected_weights", "expected_oob_ratio"),
    [(None, [0.1, 1.0, 2.0], 1 / 3), (0.5, [0.5, 1.0, 2.0], 2 / 3)],
)
def test_clipped_pg_loss_tis_min_bound_defaults_to_zero_matches_nemo(
    tis_min: float | None, expected_weights: list[float], expected_oob_ratio: float
) -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::
    test_clipped_pg_loss_tis_min_bound_defaults_to_zero.

    NeMo's ``force_on_policy_ratio`` is rlfleet's ``prev_from_training_forward`` (prev = this forward's
    logprobs, detached; the batch carries no prev). Weights exp(logprobs - 0) = [0.1, 1, 3], TIS cap 2 and
    floor ``tis_min`` (0 when unset); loss = -mean(weights).
    """
    loss_fn = _loss_fn(
        kl_penalty=0.0,
        importance_sampling_correction=True,
        prev_from_training_forward=True,
        truncation="tis",
        truncation_ratio_max=2.0,
        truncation_ratio_min=tis_min,
    )
    batch = _batch(torch.ones(1, 3), torch.ones(1), gen=torch.zeros(1, 3))
    logprobs = torch.log(torch.tensor([[0.1, 1.0, 3.0]]))
    loss, metrics = loss_fn(logprobs, batch, Normalizer(num_tokens=3, num_sequences=1))
    torch.testing.assert_close(loss, -torch.tensor(expected_weights).mean())
    assert metrics["is_oob_ratio"] == pytest.approx(expected_oob_ratio)


def test_clipped_pg_loss_seq_mask_tis_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::test_clipped_pg_loss_seq_mask_tis.

    Band [0.999, 1.002], on-policy, gen = prev - 0.0005: geometric-mean ratio exp(0.0005) is kept and the
    untruncated token weights apply. The sequence (3 tokens, advantages ``[1, -1, 2]``) goes through
    ``_sequence_copies`` so that the mask still sees whole sequences (exact here: the weights are equal along
    the sequence). Then a ``-inf`` generation logprob must leave the loss finite (NeMo's nan_to_num).
    """
    prev = PREV
    gen = torch.full((1, 3), -1.0005)
    expected = (torch.exp(prev - gen) * -ADV).mean()
    loss_fn = _loss_fn(
        kl_penalty=0.0,
        importance_sampling_correction=True,
        truncation="seq-mask-tis",
        truncation_ratio_max=1.002,
        truncation_ratio_min=0.999,
    )
    logprobs, batch, norm = _sequence_copies(prev, ADV, prev=prev, gen=gen)
    loss, metrics = loss_fn(logprobs, batch, norm)
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-3)
    assert metrics["is_oob_ratio"] == 0.0

    gen_inf = gen.clone()
    gen_inf[0, 1] = float("-inf")
    logprobs, batch, norm = _sequence_copies(prev, ADV, prev=prev, gen=gen_inf)
    loss, _ = loss_fn(logprobs, batch, norm)
    assert torch.isfinite(loss)


def test_masked_mean_all_zeros_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::test_masked_mean_all_zeros.

    The whole-tensor cases only: rlfleet's ``masked_mean`` has no ``dim`` argument.
    """
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mask = torch.zeros_like(values)
    torch.testing.assert_close(masked_mean(values, mask), torch.tensor(0.0))
    mask[0] = 1
    torch.testing.assert_close(masked_mean(values, mask), torch.tensor(1.0))


def test_clipped_pg_loss_dual_clip_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::test_clipped_pg_loss_dual_clip.

    ratio_clip_c = 3, ratios ``[0.5, 1, 10]``, advantages ``[1, -1, -4]`` (``_token_rows``): the last token's
    loss 40 is capped at 12; mean 4.1667.
    """
    adv = torch.tensor([[1.0, -1.0, -4.0]])
    prev = torch.tensor([[-1.0, -1.0, -3.0]])
    curr = torch.tensor([[-1.69315, -1.0, -0.69741]])
    clip_loss = _nemo_clip_loss(curr, prev, adv, clip_c=3.0)
    torch.testing.assert_close(clip_loss, torch.tensor([[-0.5, 1.0, 12.0]]), rtol=1e-3, atol=1e-4)
    expected = clip_loss.mean()
    torch.testing.assert_close(expected, torch.tensor(4.1667), rtol=1e-3, atol=1e-4)

    logprobs, batch, norm = _token_rows(curr, adv, prev=prev, ref=REF)
    loss, _ = _loss_fn(kl_penalty=0.0, dual_clip_c=3.0)(logprobs, batch, norm)
    torch.testing.assert_close(loss, expected)


def _gspo_loss_fn(**overrides: object) -> ClippedPGLossFn:
    return _loss_fn(kl_penalty=0.0, sequence_level_ratios=True, token_level=False, **overrides)


def test_clipped_pg_loss_gspo_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::test_clipped_pg_loss_gspo.

    Sequence ratio exp(mean(curr - prev)) = 0.9086 (inside the band), advantages ``[1, -1, 2]`` via
    ``_sequence_copies``; expected -0.6057.
    """
    max_loss = _nemo_clip_loss(CURR, PREV, ADV, sequence_level=True)
    torch.testing.assert_close(max_loss, torch.tensor([[-0.9086, 0.9086, -1.8171]]), rtol=1e-3, atol=1e-4)
    expected = max_loss.mean()
    torch.testing.assert_close(expected, torch.tensor(-0.6057), rtol=1e-3, atol=1e-4)

    logprobs, batch, norm = _sequence_copies(CURR, ADV, prev=PREV)
    loss, _ = _gspo_loss_fn()(logprobs, batch, norm)
    torch.testing.assert_close(loss, expected)


def test_clipped_pg_loss_gspo_batch_size_2_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::
    test_clipped_pg_loss_gspo_batch_size_2.

    Second sequence's ratio 2.4697 is clipped to 1.2 (for positive advantages); per-token advantages
    ``[1, -1, 2]`` in both sequences via ``_sequence_copies``; expected -0.4912.
    """
    adv = ADV.repeat(2, 1)
    prev = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    curr = CURR.repeat(2, 1)
    max_loss = _nemo_clip_loss(curr, prev, adv, sequence_level=True)
    torch.testing.assert_close(
        max_loss, torch.tensor([[-0.9086, 0.9086, -1.8171], [-1.2, 2.4697, -2.4]]), rtol=1e-3, atol=1e-4
    )
    expected = max_loss.mean()
    torch.testing.assert_close(expected, torch.tensor(-0.4912), rtol=1e-3, atol=1e-4)

    logprobs, batch, norm = _sequence_copies(curr, adv, prev=prev)
    loss, _ = _gspo_loss_fn()(logprobs, batch, norm)
    torch.testing.assert_close(loss, expected)


def test_clipped_pg_loss_gspo_importance_sampling_correction_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_loss_functions.py::
    test_clipped_pg_loss_gspo_importance_sampling_correction.

    One sequence weight exp(sum(prev - gen)) = 0.8187 times the GSPO loss; ``_sequence_copies``;
    expected -0.4959.
    """
    weight = torch.exp((PREV - GEN).sum(dim=-1, keepdim=True))
    torch.testing.assert_close(weight, torch.tensor([[0.8187]]), rtol=1e-3, atol=0.0)
    expected = (weight * _nemo_clip_loss(CURR, PREV, ADV, sequence_level=True)).mean()
    torch.testing.assert_close(expected, torch.tensor(-0.4959), rtol=1e-3, atol=1e-4)

    logprobs, batch, norm = _sequence_copies(CURR, ADV, prev=PREV, ref=REF, gen=GEN)
    loss, _ = _gspo_loss_fn(importance_sampling_correction=True)(logprobs, batch, norm)
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------------------------------------------------
# tests/unit/algorithms/test_utils.py (calculate_baseline_and_std_per_prompt), advantage_estimator.py
# ---------------------------------------------------------------------------------------------------------


def test_calculate_baseline_and_std_per_prompt_basic_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_utils.py::
    test_calculate_baseline_and_std_per_prompt_basic.

    Two prompts x 3 generations, leave-one-out baseline and std over the other samples.
    """
    baseline, std = baseline_and_std(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), 3, leave_one_out=True)
    torch.testing.assert_close(baseline, torch.tensor([2.5, 2.0, 1.5, 5.5, 5.0, 4.5]), rtol=1e-5, atol=0.0)
    torch.testing.assert_close(
        std, torch.tensor([0.707107, 1.414214, 0.707107, 0.707107, 1.414214, 0.707107]), rtol=1e-5, atol=0.0
    )


def test_calculate_baseline_and_std_per_prompt_single_generation_per_prompt_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_utils.py::
    test_calculate_baseline_and_std_per_prompt_single_generation_per_prompt
    (and the values of ::test_calculate_baseline_and_std_per_prompt_cuda_compatibility, run on CPU).

    One generation per prompt: NeMo (leave-one-out on) returns baseline = reward, std 0. rlfleet rejects a
    leave-one-out baseline with one sample, so G = 1 is checked without leave-one-out (the group mean is the
    reward: NeMo's numbers); G = 2 with leave-one-out uses NeMo's CUDA case (rewards [1, 2, 3, 4]: baseline
    the other sample, std 0).
    """
    baseline, std = baseline_and_std(torch.tensor([2.5, 4.0]), 1, leave_one_out=False)
    torch.testing.assert_close(baseline, torch.tensor([2.5, 4.0]), rtol=1e-5, atol=0.0)
    torch.testing.assert_close(std, torch.tensor([0.0, 0.0]))

    baseline, std = baseline_and_std(torch.tensor([1.0, 2.0, 3.0, 4.0]), 2, leave_one_out=True)
    torch.testing.assert_close(baseline, torch.tensor([2.0, 1.0, 4.0, 3.0]), rtol=1e-5, atol=0.0)
    torch.testing.assert_close(std, torch.zeros(4))


def test_calculate_baseline_and_std_per_prompt_identical_rewards_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_utils.py::
    test_calculate_baseline_and_std_per_prompt_identical_rewards.
    """
    rewards = torch.tensor([3.0, 3.0, 3.0, 7.0, 7.0, 7.0])
    baseline, std = baseline_and_std(rewards, 3, leave_one_out=True)
    torch.testing.assert_close(baseline, rewards, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(std, torch.zeros(6))


def test_calculate_baseline_and_std_per_prompt_mixed_prompt_sizes_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_utils.py::
    test_calculate_baseline_and_std_per_prompt_mixed_prompt_sizes.

    rlfleet takes one group size per call; NeMo computes every prompt on its own, so the batch (prompt 0
    with 2 generations, prompt 1 with 3) is checked one prompt per call, against NeMo's expected values.
    """
    baseline, std = baseline_and_std(torch.tensor([1.0, 2.0]), 2, leave_one_out=True)
    torch.testing.assert_close(baseline, torch.tensor([2.0, 1.0]), rtol=1e-5, atol=0.0)
    torch.testing.assert_close(std, torch.zeros(2))
    baseline, std = baseline_and_std(torch.tensor([4.0, 5.0, 6.0]), 3, leave_one_out=True)
    torch.testing.assert_close(baseline, torch.tensor([5.5, 5.0, 4.5]), rtol=1e-5, atol=0.0)
    torch.testing.assert_close(std, torch.tensor([0.707107, 1.414214, 0.707107]), rtol=1e-5, atol=0.0)


def test_calculate_baseline_and_std_per_prompt_empty_input_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_utils.py::
    test_calculate_baseline_and_std_per_prompt_empty_input.
    """
    baseline, std = baseline_and_std(torch.tensor([]), 3, leave_one_out=True)
    assert baseline.shape == torch.Size([0])
    assert std.shape == torch.Size([0])


def test_calculate_baseline_and_std_per_prompt_numerical_precision_matches_nemo() -> None:
    """Ported from NeMo RL tests/unit/algorithms/test_utils.py::
    test_calculate_baseline_and_std_per_prompt_numerical_precision.
    """
    rewards = torch.tensor([1e-8, 2e-8, 3e-8, 1e8, 2e8, 3e8])
    baseline, std = baseline_and_std(rewards, 3, leave_one_out=True)
    expected = torch.tensor([2.5e-8, 2e-8, 1.5e-8, 2.5e8, 2e8, 1.5e8])
    torch.testing.assert_close(baseline, expected, rtol=1e-5, atol=0.0)
    assert torch.isfinite(std).all()


def _nemo_grpo_advantages(rewards: list[float], leave_one_out: bool, normalize: bool) -> list[float]:
    """NeMo RL's ``GRPOAdvantageEstimator.compute_advantage`` for one prompt, all samples valid, in float64.

    ``calculate_baseline_and_std_per_prompt``: baseline = mean over the samples ``baseline_mask_matrix``
    selects (all, or all but self), std = sqrt((E[r^2] - E[r]^2) * n / (n - 1)) over the same n samples,
    NaN -> 0; then advantage = r - baseline, divided by (std + 1e-6) where std > 0.
    """
    g = len(rewards)
    out = []
    for i, r in enumerate(rewards):
        peers = [rewards[j] for j in range(g) if j != i or not leave_one_out]
        n = len(peers)
        mean = sum(peers) / n
        square = sum(p * p for p in peers) / n
        var = (square - mean * mean) * (n / (n - 1)) if n > 1 else math.nan
        std = 0.0 if math.isnan(var) or var < 0 else math.sqrt(var)
        adv = r - mean
        out.append(adv / (std + 1e-6) if normalize and std > 0 else adv)
    return out


@pytest.mark.parametrize("leave_one_out", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
def test_grpo_advantage_estimator_matches_nemo(leave_one_out: bool, normalize: bool) -> None:
    """Matches NeMo RL nemo_rl/algorithms/advantage_estimator.py::GRPOAdvantageEstimator.compute_advantage
    (no peer unit test; expected values hand-computed from its code, ``_nemo_grpo_advantages``).

    Groups [1, 0, 0, 0] and [1, 2, 3] (one call per group size). Leave-one-out + normalisation (NeMo's
    defaults): [1, 0, 0, 0] -> [1, -1/3 / (sqrt(1/3) + 1e-6) x 3] (the lone success's peers have zero spread,
    so it keeps its raw advantage) and [1, 2, 3] -> [-1.5 / (sqrt(0.5) + 1e-6), 0, 1.5 / (sqrt(0.5) + 1e-6)].
    """
    literal = {
        (True, True): ([1.0, *[-(1 / 3) / (math.sqrt(1 / 3) + 1e-6)] * 3], [-2.121317, 0.0, 2.121317]),
        (False, True): ([0.75 / 0.500001, *[-0.25 / 0.500001] * 3], [-1 / 1.000001, 0.0, 1 / 1.000001]),
        (True, False): ([1.0, -1 / 3, -1 / 3, -1 / 3], [-1.5, 0.0, 1.5]),
        (False, False): ([0.75, -0.25, -0.25, -0.25], [-1.0, 0.0, 1.0]),
    }[(leave_one_out, normalize)]
    for rewards, anchor in zip(([1.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0]), literal, strict=True):
        expected = _nemo_grpo_advantages(rewards, leave_one_out, normalize)
        assert expected == pytest.approx(anchor, rel=1e-5, abs=1e-7)
        actual = group_advantages(
            torch.tensor(rewards), len(rewards), leave_one_out=leave_one_out, normalize=normalize
        )
        torch.testing.assert_close(actual, torch.tensor(expected), rtol=1e-5, atol=1e-6)
