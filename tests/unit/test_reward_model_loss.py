"""The Bradley-Terry reward-model loss (``PreferenceLossFn``, NeMo RL's) and where a row's score is read.

Closed forms without a model; then a two-layer sequence classifier built in-process: its per-token scores
read at each row's last token are transformers' pooled scores, padded, packed or dynamically batched alike.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification, LlamaConfig

from rlfleet.models.loading import is_reward_model
from rlfleet.policy.batch import TrainBatch, collate
from rlfleet.policy.logprobs import forward_logprobs, model_logprobs
from rlfleet.policy.loss_functions import PreferenceLossFn
from rlfleet.policy.loss_math import Normalizer, last_token_index
from rlfleet.policy.microbatch import MicroBatching, plan_micro_batches, row_lengths

PAD = 0


def pairs_batch(lengths: list[int], seed: int = 0) -> TrainBatch:
    """Rows of random tokens (no padding id among them) of ``lengths``, a 2-token prompt each."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 60, (n,), generator=gen).tolist() for n in lengths]
    return collate([r[:2] for r in rows], [r[2:] for r in rows], PAD)


def whole(batch: TrainBatch) -> Normalizer:
    return Normalizer(float(batch.response_mask.sum()), float(len(batch)))


def scores_at_ends(batch: TrainBatch, values: list[float]) -> torch.Tensor:
    """``[n, T]`` per-token scores: noise everywhere, ``values[i]`` at row ``i``'s last token."""
    scores = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(1))
    last = batch.attention_mask.sum(dim=1) - 1
    scores[torch.arange(len(batch)), last] = torch.tensor(values)
    return scores


def test_equal_scores_give_ln2_and_the_metrics_are_nemo_rls() -> None:
    batch = pairs_batch([5, 7, 4, 6])
    loss, metrics = PreferenceLossFn()(scores_at_ends(batch, [0.3, 0.3, -1.0, -1.0]), batch, whole(batch))
    assert float(loss) == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["accuracy"] == 0.0  # a tie is not a win
    assert metrics["rewards_chosen_mean"] == pytest.approx(-0.35)
    assert metrics["rewards_rejected_mean"] == pytest.approx(-0.35)
    assert metrics["num_valid_samples"] == 2
    loss, metrics = PreferenceLossFn()(scores_at_ends(batch, [2.0, 0.0, 0.0, 1.0]), batch, whole(batch))
    closed = (-math.log(1 / (1 + math.exp(-2.0))) - math.log(1 / (1 + math.exp(1.0)))) / 2
    assert float(loss) == pytest.approx(closed, abs=1e-6) and metrics["loss"] == pytest.approx(closed)
    assert metrics["accuracy"] == 0.5


def test_the_gradient_raises_the_chosen_score_and_lowers_the_rejected_one() -> None:
    batch = pairs_batch([5, 7])
    scores = scores_at_ends(batch, [0.1, 0.4]).requires_grad_()
    loss, _ = PreferenceLossFn()(scores, batch, whole(batch))
    loss.backward()
    assert scores.grad is not None
    last = batch.attention_mask.sum(dim=1) - 1
    chosen, rejected = scores.grad[0, last[0]], scores.grad[1, last[1]]
    # d/dr_chosen of -log sigmoid(r_c - r_r) = -(1 - sigmoid(r_c - r_r))
    assert float(chosen) == pytest.approx(-(1 - torch.sigmoid(torch.tensor(-0.3))).item(), abs=1e-6)
    assert float(rejected) == pytest.approx(-float(chosen), abs=1e-6)
    assert float(scores.grad.abs().sum()) == pytest.approx(2 * abs(float(chosen)))  # only the last tokens


def test_micro_batch_shares_in_pairs_sum_to_the_whole_batch() -> None:
    batch = pairs_batch([5, 9, 4, 6, 8, 3, 7, 5])
    scores = scores_at_ends(batch, [0.5, -0.2, 1.0, 1.5, -0.3, 0.0, 0.7, 0.1])
    loss_fn, norm = PreferenceLossFn(), whole(batch)
    full, full_metrics = loss_fn(scores, batch, norm)
    for batching in (MicroBatching(rows=2, pairs=True), MicroBatching(rows=2, tokens=20, pairs=True)):
        total, metrics = torch.zeros(()), dict.fromkeys(full_metrics, 0.0)
        for rows in plan_micro_batches(row_lengths(batch), batching)[0]:
            mb = batch.take(rows)
            loss, mb_metrics = loss_fn(scores[rows][:, : mb.input_ids.shape[1]], mb, norm)
            total = total + loss
            metrics = {k: metrics[k] + mb_metrics[k] for k in metrics}
        assert float(total) == pytest.approx(float(full), abs=1e-6)
        assert metrics == pytest.approx(full_metrics)
    with pytest.raises(ValueError, match="whole"):
        loss_fn(scores[:3], batch.take([0, 1, 2]), norm)


def test_last_token_is_the_last_real_one_and_with_the_padding_id_transformers_rule() -> None:
    input_ids = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 2, 2, 2], [4, 4, 4, 4, 4]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    assert last_token_index(input_ids, mask).tolist() == [2, 3, 4]
    # padding id 2 (= EOS, say) ending row 1: transformers' head reads its last token that is not 2
    assert last_token_index(input_ids, mask, pad_token_id=2).tolist() == [2, 1, 4]


# ---------------------------------------------------------------------------------- a real score head


@pytest.fixture(scope="module")
def reward_model() -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=PAD,
        num_labels=1,
    )
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
    return model.eval()


@pytest.mark.parametrize(
    "batching",
    [
        MicroBatching(rows=2, pairs=True),
        MicroBatching(rows=2, tokens=40, pack=True, pairs=True),
        MicroBatching(rows=2, tokens=40, round_to=8, pairs=True),
    ],
    ids=["padded", "packed", "dynamic"],
)
def test_scores_at_the_last_token_are_the_pooled_scores_in_every_layout(
    reward_model: torch.nn.Module, batching: MicroBatching
) -> None:
    assert is_reward_model(reward_model)
    batch = pairs_batch([5, 9, 4, 6, 8, 3])
    last = batch.attention_mask.sum(dim=1) - 1
    with torch.no_grad():
        pooled = reward_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, 0]
        read = torch.zeros(len(batch))
        for rows in plan_micro_batches(row_lengths(batch), batching)[0]:
            mb = batch.take(rows)
            scores = forward_logprobs(reward_model, mb, batching, temperature=0.7)  # no temperature
            read[rows] = scores[torch.arange(len(rows)), last[rows]]
    torch.testing.assert_close(read, pooled, rtol=1e-5, atol=1e-5)


def test_a_reward_model_refuses_chunked_logprobs(reward_model: torch.nn.Module) -> None:
    batch = pairs_batch([4, 5])
    with pytest.raises(ValueError, match="logprob_chunk_size=null"):
        model_logprobs(reward_model, batch.input_ids, 1.0, 8, attention_mask=batch.attention_mask)
