"""DPO's loss (``DPOLossFn``) and its micro-batching in pairs.

The first three tests port NeMo RL's cases (``tests/unit/algorithms/test_loss_functions.py``:
``test_dpo_loss``, ``test_dpo_loss_varying_sequence_lengths``, ``test_dpo_sft_matches_nll_loss``), whose
fixtures are drawn on CUDA there: the inputs are rebuilt on the CPU from logits and checked against the
closed forms. Rows ``2i``/``2i + 1`` are a pair's chosen/rejected responses, as in NeMo RL.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.logprobs import logprobs_from_logits
from rlfleet.policy.loss_functions import DPOLossFn, NLLLossFn
from rlfleet.policy.loss_math import Normalizer
from rlfleet.policy.microbatch import MicroBatching, plan_micro_batches, plan_trained_micro_batches


def dpo_batch(
    input_ids: torch.Tensor, token_mask: torch.Tensor, ref: torch.Tensor | None = None
) -> TrainBatch:
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        response_mask=token_mask.float(),
        ref_logprobs=torch.zeros(input_ids.shape) if ref is None else ref,
    )


def whole(batch: TrainBatch) -> Normalizer:
    return Normalizer(float(batch.response_mask.sum()), float(len(batch)))


def run(loss_fn: DPOLossFn | NLLLossFn, logits: torch.Tensor, batch: TrainBatch):
    return loss_fn(logprobs_from_logits(logits, batch.input_ids, 1.0), batch, whole(batch))


def nemo_fixture(vocab_size: int = 16) -> tuple[TrainBatch, torch.Tensor]:
    """NeMo RL's ``setup_dpo_loss_test_data``: one pair of 4 tokens (the last two the response), zero
    logits."""
    input_ids = torch.arange(vocab_size // 2).reshape(2, 4).long()
    batch = dpo_batch(input_ids, torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1]]))
    return batch, torch.zeros((2, 4, vocab_size))


def test_dpo_loss_at_equal_rewards_is_ln2_and_sft_adds_its_closed_form() -> None:
    """NeMo RL ``test_dpo_loss``: zero logits give equal rewards, so ln 2; with ``sft_loss_weight=0.5`` and a
    vocabulary of 16, ln 2 + 0.5 * 2 tokens * ln 16."""
    batch, logits = nemo_fixture()
    loss, _ = run(DPOLossFn(reference_policy_kl_penalty=0.0), logits, batch)
    assert float(loss) == pytest.approx(math.log(2), abs=1e-6)
    with_sft = DPOLossFn(reference_policy_kl_penalty=0.0, sft_loss_weight=0.5)
    loss, metrics = run(with_sft, logits, batch)
    assert float(loss) == pytest.approx(math.log(2) + 0.5 * 2 * math.log(16), abs=1e-5)
    assert metrics["sft_loss"] == pytest.approx(2 * math.log(16), abs=1e-5)
    assert metrics["preference_loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_dpo_logs_a_zero_sft_loss_without_its_weight_as_nemo_rl_does() -> None:
    """NeMo RL's ``DPOLossFn`` computes the SFT term only when ``sft_loss_weight > 0`` and logs
    ``sft_loss = 0`` otherwise: a metric with its name means its thing (the chosen NLL is 2 ln 16 here)."""
    batch, logits = nemo_fixture()
    _, without = run(DPOLossFn(reference_policy_kl_penalty=0.0), logits, batch)
    _, weighted = run(DPOLossFn(reference_policy_kl_penalty=0.0, sft_loss_weight=1e-6), logits, batch)
    assert without["sft_loss"] == 0.0
    assert weighted["sft_loss"] == pytest.approx(2 * math.log(16), abs=1e-5)
    assert without["loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_dpo_sft_loss_sums_or_averages_tokens_per_response() -> None:
    """NeMo RL ``test_dpo_loss_varying_sequence_lengths``: two pairs of lengths 3, 5, 4, 6; the SFT term is
    the chosen responses' summed NLL averaged over pairs, or with ``sft_average_log_probs`` their token
    mean (NeMo's check divides by the chosen tokens of the batch, equal here as both means are uniform)."""
    input_ids = torch.zeros((4, 6), dtype=torch.long)
    token_mask = torch.zeros((4, 6))
    for row, length in enumerate((3, 5, 4, 6)):
        input_ids[row, :length] = torch.arange(length)
        token_mask[row, :length] = 1.0
    token_mask[:, 0] = 0.0  # position 0 has no logprob (NeMo's token_mask[:, 1:])
    logits = torch.zeros((4, 6, 10))
    batch = dpo_batch(input_ids, token_mask)
    _, plain = run(DPOLossFn(0.1, sft_loss_weight=0.5), logits, batch)
    _, averaged = run(
        DPOLossFn(0.1, sft_loss_weight=0.5, preference_average_log_probs=True, sft_average_log_probs=True),
        logits,
        batch,
    )
    per_token = math.log(10)  # every token's NLL under zero logits
    chosen_tokens = [2, 3]  # rows 0 and 2: lengths 3 and 4, less position 0
    assert plain["sft_loss"] == pytest.approx(per_token * sum(chosen_tokens) / 2, rel=1e-6)
    assert averaged["sft_loss"] == pytest.approx(per_token, rel=1e-6)


def test_dpo_sft_term_matches_the_nll_loss_on_the_chosen_responses() -> None:
    """NeMo RL ``test_dpo_sft_matches_nll_loss``: with ``preference_loss_weight=0`` DPO's loss is the NLL of
    the chosen rows, a per-response sum averaged over pairs (rescaled to NLLLossFn's token mean)."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 8, (4, 5), generator=generator)
    token_mask = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    ref = torch.randn((4, 5), generator=generator)
    logits = torch.randn((4, 5, 8), generator=generator)
    dpo, _ = run(
        DPOLossFn(0.0, preference_loss_weight=0.0, sft_loss_weight=1.0),
        logits,
        dpo_batch(input_ids, token_mask, ref),
    )
    chosen = dpo_batch(input_ids[::2], token_mask[::2])
    nll, _ = run(NLLLossFn(), logits[::2], chosen)
    chosen_tokens = float(token_mask[::2].sum())
    torch.testing.assert_close(dpo * 2 / chosen_tokens, nll)


def test_first_step_loss_is_ln2_when_policy_and_reference_agree() -> None:
    """NeMo RL's functional check (``tests/functional/dpo.sh``): the first step's loss lies in
    (0.69314, 0.69316) because the policy starts as the reference."""
    generator = torch.Generator().manual_seed(1)
    logprobs = -torch.rand((6, 7), generator=generator)
    batch = dpo_batch(
        torch.zeros((6, 7), dtype=torch.long),
        (torch.rand((6, 7), generator=generator) > 0.3),
        logprobs.clone(),
    )
    loss, metrics = DPOLossFn(0.05)(logprobs, batch, whole(batch))
    assert 0.69314 < float(loss) < 0.69316
    assert metrics["accuracy"] == 0.0 and metrics["num_valid_samples"] == 3


def test_preference_gradient_raises_chosen_and_lowers_rejected() -> None:
    """The closed form: d loss / d r_chosen = -beta * sigmoid(-beta * (r_c - r_r)) / pairs, and the opposite
    for the rejected response; accuracy and the reward means as NeMo RL reports them."""
    beta = 0.5
    logprobs = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -0.5]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.5, -1.5], [0.0, -1.0, -1.0]])
    batch = dpo_batch(torch.zeros((2, 3), dtype=torch.long), torch.tensor([[0, 1, 1], [0, 1, 1]]), ref)
    loss, metrics = DPOLossFn(beta)(logprobs, batch, whole(batch))
    loss.backward()
    r_chosen, r_rejected = 0.0, 1.0  # (-1 + 1.5) + (-2 + 1.5) and (-0.5 + 1) * 2
    expected = -math.log(1 / (1 + math.exp(-beta * (r_chosen - r_rejected))))
    assert float(loss.detach()) == pytest.approx(expected)
    slope = beta / (1 + math.exp(beta * (r_chosen - r_rejected)))
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -slope, -slope], [0.0, slope, slope]]))
    assert metrics["accuracy"] == 0.0
    assert metrics["rewards_chosen_mean"] == pytest.approx(r_chosen)
    assert metrics["rewards_rejected_mean"] == pytest.approx(r_rejected)


def test_micro_batch_shares_sum_to_the_whole_batch_loss() -> None:
    """Pairs split over micro-batches: the shares (global normaliser) add up to the loss of all pairs at
    once."""
    generator = torch.Generator().manual_seed(2)
    logprobs = -torch.rand((8, 6), generator=generator)
    ref = -torch.rand((8, 6), generator=generator)
    batch = dpo_batch(torch.zeros((8, 6), dtype=torch.long), torch.ones((8, 6)), ref)
    loss_fn = DPOLossFn(0.3, sft_loss_weight=0.2)
    full, full_metrics = loss_fn(logprobs, batch, whole(batch))
    parts = [loss_fn(logprobs[i : i + 2], batch.select(i, i + 2), whole(batch)) for i in range(0, 8, 2)]
    torch.testing.assert_close(sum(p[0] for p in parts), full)
    assert sum(p[1]["accuracy"] for p in parts) == pytest.approx(full_metrics["accuracy"])


def test_odd_micro_batch_is_refused() -> None:
    batch = dpo_batch(torch.zeros((3, 4), dtype=torch.long), torch.ones((3, 4)))
    with pytest.raises(ValueError, match="whole"):
        DPOLossFn()(torch.zeros((3, 4)), batch, whole(batch))


@pytest.mark.parametrize(
    "batching",
    [
        MicroBatching(rows=4, pairs=True),
        MicroBatching(rows=2, pairs=True),
        MicroBatching(rows=1, tokens=40, round_to=4, pairs=True),
        MicroBatching(rows=1, tokens=40, pack=True, pairs=True),
        MicroBatching(rows=1, tokens=40, pack=True, algorithm="modified_first_fit_decreasing", pairs=True),
    ],
    ids=["rows4", "rows2", "dynamic", "packed", "packed-mffd"],
)
@pytest.mark.parametrize("shards", [1, 2])
def test_pair_planning_keeps_each_pair_together_in_order(batching: MicroBatching, shards: int) -> None:
    lengths = [5, 9, 12, 3, 7, 7, 15, 4, 6, 11, 2, 8]
    plans = plan_micro_batches(lengths, batching, shards)
    share = len(lengths) // shards
    seen = []
    for shard, plan in enumerate(plans):
        assert len(plan) == len(plans[0])  # equal forward passes on every rank
        for group in plan:
            assert len(group) % 2 == 0
            assert all(group[i] % 2 == 0 and group[i + 1] == group[i] + 1 for i in range(0, len(group), 2))
            rows = [shard * share + i for i in group]
            widths = [lengths[r] for r in rows]
            if batching.pack:
                assert sum(widths) <= 40
            elif batching.tokens is not None:
                assert len(rows) * -(-max(widths) // 4) * 4 <= 40
            else:
                assert len(rows) <= batching.rows
            seen += rows
    assert sorted(seen) == list(range(len(lengths)))


def test_pair_planning_refusals_say_why() -> None:
    with pytest.raises(ValueError, match=r"twice policy\.max_total_sequence_length"):
        plan_micro_batches([30, 20], MicroBatching(rows=1, tokens=40, pack=True, pairs=True))
    with pytest.raises(ValueError, match="whole"):
        plan_micro_batches([3, 4, 5, 6], MicroBatching(rows=2, pairs=True), num_shards=4)
    with pytest.raises(ValueError, match="skipped"):
        plan_trained_micro_batches([3, 4], [True, False], MicroBatching(rows=2, pairs=True))
    with pytest.raises(ValueError, match="at least 2 rows"):
        MicroBatching(rows=1, pairs=True)
