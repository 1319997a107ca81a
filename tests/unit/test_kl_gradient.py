"""The KL penalty's expected gradient, by exact enumeration over a small vocabulary.

A one-step policy ``pi = softmax(theta)`` over ``V`` tokens and a fixed reference. The loss sees one
sampled token at a time, so the gradient an optimiser follows on average is
``sum_y q(y) * grad L(y)`` with ``q`` the distribution the tokens were sampled from (``pi`` itself, or a
generation engine's ``q`` with ``loss_fn.use_on_policy_kl_approximation``). For every estimator shipped
that sum must equal ``torch.autograd`` of the closed form ``KL(pi || pi_ref)``, in float64, to 1e-9.

Without the score-function weight (rlfleet before this test, NeMo RL before its PR #2506) the k3 term's
expected gradient is that of ``KL(pi_ref || pi)`` instead: :func:`test_unweighted_k3_follows_the_reverse_kl`
pins that, so the weighted form is what makes the tests below pass.
"""

from __future__ import annotations

import pytest
import torch

from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.loss_functions import ClippedPGLossFn
from rlfleet.policy.loss_math import KL_TYPES, KLType, Normalizer, kl_estimate, kl_gradient_weights

V = 6


def _policies(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``theta`` (leaf, [V]), the reference's and a sampler's logprobs ([V]), float64, well inside the
    clamps (|x| < 20, k < 10)."""
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(V, generator=gen, dtype=torch.float64).requires_grad_(True)
    ref = torch.log_softmax(torch.randn(V, generator=gen, dtype=torch.float64), dim=0)
    sampler = torch.log_softmax(torch.randn(V, generator=gen, dtype=torch.float64), dim=0)
    return theta, ref, sampler


def _closed_form_gradients(theta: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad KL(pi || ref)`` and ``grad KL(ref || pi)`` by autograd of the closed forms."""
    logp = torch.log_softmax(theta, dim=0)
    forward = (logp.exp() * (logp - ref)).sum()
    reverse = (ref.exp() * (ref - logp)).sum()
    (g_forward,) = torch.autograd.grad(forward, theta, retain_graph=True)
    (g_reverse,) = torch.autograd.grad(reverse, theta)
    return g_forward, g_reverse


def _loss_fn(kl_type: KLType, on_policy_approx: bool, variant: str) -> ClippedPGLossFn:
    return ClippedPGLossFn(
        eps_low=0.2,
        eps_high=0.2,
        dual_clip_c=None,
        kl_penalty=1.0,
        kl_input_clamp=20.0,
        kl_output_clamp=10.0,
        token_level=variant == "token",
        importance_sampling_correction=False,
        kl_type=kl_type,
        use_on_policy_kl_approximation=on_policy_approx,
        prev_from_training_forward=variant == "prev_from_forward",
        sequence_level_ratios=variant == "gspo",
    )


def _expected_loss_gradient(
    loss_fn: ClippedPGLossFn, theta: torch.Tensor, ref: torch.Tensor, sampler: torch.Tensor
) -> torch.Tensor:
    """``sum_y exp(sampler[y]) * grad L(y)``: the loss of one sampled token ``y`` (a one-token response,
    advantage 0 so only the KL term acts), its gradient weighted by the probability of sampling ``y``."""
    total = torch.zeros_like(theta)
    for y in range(V):
        logp = torch.log_softmax(theta, dim=0)[y].reshape(1, 1)
        batch = TrainBatch(
            input_ids=torch.tensor([[y]]),
            attention_mask=torch.ones(1, 1, dtype=torch.long),
            response_mask=torch.ones(1, 1, dtype=torch.float64),
            advantages=torch.zeros(1, dtype=torch.float64),
            prev_logprobs=None if loss_fn.prev_from_training_forward else logp.detach(),
            ref_logprobs=ref[y].reshape(1, 1),
            generation_logprobs=sampler[y].reshape(1, 1),
        )
        loss, _ = loss_fn(logp, batch, Normalizer(num_tokens=1.0, num_sequences=1.0))
        (grad,) = torch.autograd.grad(loss, theta)
        total += sampler[y].exp() * grad
    return total


@pytest.mark.parametrize("variant", ["token", "sequence", "gspo", "prev_from_forward"])
@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_expected_kl_gradient_is_that_of_kl_pi_to_ref_on_policy(kl_type: KLType, variant: str) -> None:
    theta, ref, _ = _policies()
    pi = torch.log_softmax(theta, dim=0).detach()  # the tokens are sampled from pi itself
    expected, _ = _closed_form_gradients(theta, ref)
    got = _expected_loss_gradient(_loss_fn(kl_type, False, variant), theta, ref, pi)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)


@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_on_policy_kl_approximation_corrects_for_another_sampler(kl_type: KLType, seed: int) -> None:
    """Tokens drawn from ``q != pi`` (an older or differently computed sampler): weighting by ``pi / q``
    (``use_on_policy_kl_approximation``) recovers ``grad KL(pi || ref)``; without it the expectation is
    taken under the wrong distribution."""
    theta, ref, sampler = _policies(seed)
    expected, _ = _closed_form_gradients(theta, ref)
    got = _expected_loss_gradient(_loss_fn(kl_type, True, "token"), theta, ref, sampler)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)
    uncorrected = _expected_loss_gradient(_loss_fn(kl_type, False, "token"), theta, ref, sampler)
    assert (uncorrected - expected).abs().max() > 1e-3


def test_unweighted_k3_follows_the_reverse_kl() -> None:
    """The defect the weights fix: differentiating k3 as is gives ``grad KL(ref || pi)`` in expectation."""
    theta, ref, _ = _policies()
    forward, reverse = _closed_form_gradients(theta, ref)
    logp = torch.log_softmax(theta, dim=0)
    pi = logp.detach().exp()
    unweighted = (pi * kl_estimate(logp, ref, "k3", None, None)).sum()
    (grad,) = torch.autograd.grad(unweighted, theta)
    torch.testing.assert_close(grad, reverse, rtol=0, atol=1e-9)
    assert (grad - forward).abs().max() > 1e-3


def test_k1_without_the_weight_has_no_expected_gradient() -> None:
    theta, ref, _ = _policies()
    logp = torch.log_softmax(theta, dim=0)
    unweighted = (logp.detach().exp() * kl_estimate(logp, ref, "k1", None, None)).sum()
    (grad,) = torch.autograd.grad(unweighted, theta)
    torch.testing.assert_close(grad, torch.zeros_like(grad), rtol=0, atol=1e-12)


def test_k2_with_a_score_weight_would_be_biased() -> None:
    """Why k2's weight is detached (a departure from NeMo RL, which weights k2 like k1 and k3): k2's own
    gradient already is grad KL(pi || ref) on-policy, and the score term would add E[k2 grad log pi]."""
    theta, ref, _ = _policies()
    forward, _ = _closed_form_gradients(theta, ref)
    logp = torch.log_softmax(theta, dim=0)
    pi = logp.detach().exp()
    nemo_weight = torch.exp(logp - logp.detach())
    biased = (pi * kl_estimate(logp, ref, "k2", None, None, nemo_weight)).sum()
    (grad,) = torch.autograd.grad(biased, theta)
    assert (grad - forward).abs().max() > 1e-3
    weights = kl_gradient_weights(logp, "k2")
    assert not weights.requires_grad and torch.equal(weights, torch.ones_like(weights))


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_weights_leave_the_value_unchanged_on_policy(kl_type: KLType) -> None:
    """The on-policy weight is exactly 1 in value: the reported KL and the loss value do not move."""
    logp = torch.log_softmax(torch.randn(3, 5, dtype=torch.float64), dim=1).requires_grad_(True)
    ref = torch.log_softmax(torch.randn(3, 5, dtype=torch.float64), dim=1)
    weighted = kl_estimate(logp, ref, kl_type, 20.0, 10.0, kl_gradient_weights(logp, kl_type))
    assert torch.equal(weighted.detach(), kl_estimate(logp, ref, kl_type, 20.0, 10.0).detach())
