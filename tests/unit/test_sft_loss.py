"""SFT's loss: the negative log-likelihood of the response tokens alone (token- and sequence-level)."""

from __future__ import annotations

import pytest
import torch

from rlfleet.algorithms.sft.loop import sft_batch
from rlfleet.data import Example, Prompt, render_prompt, response_target
from rlfleet.models.tiny import train_tokenizer
from rlfleet.policy.batch import TrainBatch, collate
from rlfleet.policy.loss_functions import NLLLossFn
from rlfleet.policy.loss_math import Normalizer

# Two rows: prompts of 3 and 2 tokens, responses of 2 and 3 tokens, right-padded to 5 columns.
PROMPTS, RESPONSES = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]]
# log p of each position (position 0 has no prediction); -9 marks prompt positions, -7 padding.
LOGPROBS = [
    [0.0, -9.0, -9.0, -1.0, -2.0],  # response at columns 3, 4
    [0.0, -9.0, -0.5, -1.5, -4.0],  # response at columns 2, 3, 4
]


def two_rows() -> tuple[TrainBatch, torch.Tensor]:
    return collate(PROMPTS, RESPONSES, pad_token_id=0), torch.tensor(LOGPROBS, dtype=torch.float64)


def whole_batch(batch: TrainBatch) -> Normalizer:
    return Normalizer(num_tokens=float(batch.response_mask.sum()), num_sequences=float(len(batch)))


def test_response_mask_of_the_hand_example() -> None:
    batch, _ = two_rows()
    assert batch.response_mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]


@pytest.mark.parametrize(
    ("token_level", "expected"),
    [
        (True, (1.0 + 2.0 + 0.5 + 1.5 + 4.0) / 5),  # 1.8: mean over the 5 response tokens
        (False, ((1.0 + 2.0) / 2 + (0.5 + 1.5 + 4.0) / 3) / 2),  # 1.75: mean of the per-row means
    ],
    ids=["token-level", "sequence-level"],
)
def test_nll_by_hand(token_level: bool, expected: float) -> None:
    batch, logprobs = two_rows()
    loss, metrics = NLLLossFn(token_level=token_level)(logprobs, batch, whole_batch(batch))
    assert float(loss) == pytest.approx(expected, abs=1e-12)
    assert metrics == {"loss": pytest.approx(expected, abs=1e-12)}


@pytest.mark.parametrize("token_level", [True, False], ids=["token-level", "sequence-level"])
def test_micro_batch_shares_add_up_to_the_whole_batch(token_level: bool) -> None:
    """Each micro-batch is divided by the global counts, so the shares sum to the one-batch loss."""
    batch, logprobs = two_rows()
    loss_fn, norm = NLLLossFn(token_level=token_level), whole_batch(batch)
    whole, _ = loss_fn(logprobs, batch, norm)
    shares = [loss_fn(logprobs[i : i + 1], batch.select(i, i + 1), norm)[0] for i in range(2)]
    assert float(sum(shares)) == pytest.approx(float(whole), abs=1e-12)
    assert float(shares[0]) == pytest.approx(3.0 / 5 if token_level else 1.5 / 2, abs=1e-12)


@pytest.mark.parametrize("token_level", [True, False], ids=["token-level", "sequence-level"])
def test_only_response_tokens_count(token_level: bool) -> None:
    batch, logprobs = two_rows()
    loss_fn, norm = NLLLossFn(token_level=token_level), whole_batch(batch)
    base, _ = loss_fn(logprobs, batch, norm)
    outside = (1 - batch.response_mask).to(torch.float64)  # prompt positions and padding

    # Any change to the prompt (and padding) logprobs leaves the loss exactly as it was ...
    noise = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    moved, _ = loss_fn(logprobs + 5.0 * noise * outside, batch, norm)
    assert torch.equal(moved, base)
    # ... while a change to one response token's logprob moves it by that change over its normaliser.
    bumped = logprobs.clone()
    bumped[1, 3] += 0.3
    changed, _ = loss_fn(bumped, batch, norm)
    per_token = 1 / 5 if token_level else 1 / (3 * 2)  # row 1 has 3 response tokens, the batch 2 rows
    assert float(changed - base) == pytest.approx(-0.3 * per_token, abs=1e-12)

    # The gradient reaches the response tokens only.
    leaf = logprobs.clone().requires_grad_(True)
    loss_fn(leaf, batch, norm)[0].backward()
    assert leaf.grad is not None
    assert torch.equal(leaf.grad * outside, torch.zeros_like(leaf.grad))
    assert bool((leaf.grad[batch.response_mask.bool()] < 0).all())


def test_sft_batch_trains_on_the_answer_and_eos_only() -> None:
    """``sft_batch``: the rendered prompt, then the worked answer and EOS; the mask is 1 on those alone."""
    rows = [
        Example("What is 2 + 3?", "2 + 3 = 5\n#### 5", "5"),
        Example("What is 7 - 4 - 1?", "7 - 4 = 3\n3 - 1 = 2\n#### 2", "2"),
    ]
    tokenizer = train_tokenizer([r.question + " " + r.answer for r in rows] * 4, 300)
    prompts = []
    for row in rows:
        text = render_prompt(tokenizer, row.question, None)
        prompts.append(Prompt(row, text, tuple(tokenizer(text, add_special_tokens=False)["input_ids"])))

    batch = sft_batch(prompts, tokenizer, tokenizer.pad_token_id)

    for i, prompt in enumerate(prompts):
        target = response_target(tokenizer, prompt.example.answer)
        assert target[-1] == tokenizer.eos_token_id
        start, end = len(prompt.token_ids), len(prompt.token_ids) + len(target)
        assert batch.input_ids[i, :start].tolist() == list(prompt.token_ids)
        assert batch.input_ids[i, start:end].tolist() == target
        mask = [0.0] * start + [1.0] * len(target) + [0.0] * (batch.input_ids.shape[1] - end)
        assert batch.response_mask[i].tolist() == mask
        trained_on = batch.input_ids[i][batch.response_mask[i].bool()]
        assert tokenizer.decode(trained_on, skip_special_tokens=True) == prompt.example.answer
