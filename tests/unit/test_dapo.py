"""DAPO's pieces as pure functions: overlong shaping, truncated-row masking, dynamic sampling, and how many
rows a step with fewer than ``P x G`` rows trains on."""

import pytest
import torch

from rlfleet.algorithms.overlong import mask_truncated, overlong_penalty, shape_overlong_rewards
from rlfleet.rollouts.dynamic_sampling import collect_informative_groups, informative_groups, trainable_rows


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 16, 17, 20, 24, 30])
    # limit 24, buffer 8: free up to 16 tokens, then -1/8 per token, -1 at 24 and beyond
    pen = overlong_penalty(lengths, 24, 8, 1.0)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.125, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 24, 8, 0.5), pen * 0.5)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    torch.testing.assert_close(
        shape_overlong_rewards(rewards, lengths, 24, 8, 1.0), torch.tensor([1.0, 1.0, 0.875, -0.5, 0.0, -1.0])
    )
    with pytest.raises(ValueError, match="does not fit"):
        overlong_penalty(lengths, 4, 8, 1.0)


def test_overlong_penalty_matches_a_float64_reference():
    lengths = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(0))
    limit, buf, p = 256, 37, 0.7

    def ref(n: int) -> float:
        if n <= limit - buf:
            return 0.0
        if n <= limit:
            return -p * (n - (limit - buf)) / buf
        return -p

    expected = torch.tensor([ref(int(n)) for n in lengths], dtype=torch.float32)
    torch.testing.assert_close(overlong_penalty(lengths, limit, buf, p), expected)


def test_mask_truncated_zeroes_whole_rows():
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    out = mask_truncated(mask, torch.tensor([True, False]))
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))


def test_informative_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    assert informative_groups(rewards, 2).tolist() == [False, True, False, False]


def _rounds(*groups_per_round: list[list[float]]):
    """A draw function returning the given rounds of groups (rewards), and the call log."""
    calls: list[int] = []

    def draw(r: int) -> list[tuple[int, int, float]]:
        calls.append(r)
        return [(r, g, x) for g, group in enumerate(groups_per_round[r]) for x in group]

    return draw, calls


def test_dynamic_sampling_fills_then_stops_and_discards_the_surplus():
    draw, calls = _rounds(
        [[1, 1], [0, 1], [0, 0]],  # one informative group
        [[1, 0], [1, 1], [0, 1]],  # two more: the target of 2 is passed, the third is surplus
        [[0, 1], [0, 1], [0, 1]],
    )
    out = collect_informative_groups(draw, lambda s: s[2], group_size=2, target_groups=2, max_rounds=5)
    assert calls == [0, 1]
    assert out.filled and out.rounds == 2 and out.prompts_drawn == 6
    assert out.groups_kept == 2 and out.groups_discarded == 1
    assert [(r, g) for r, g, _ in out.samples[::2]] == [(0, 1), (1, 0)]
    assert out.metrics()["train/dynamic_sampling_filled"] == 1.0


def test_dynamic_sampling_is_bounded_and_trains_on_what_it_has():
    draw, calls = _rounds([[1, 1], [0, 1]], [[0, 0], [1, 1]], [[1, 0], [0, 0]], [[0, 1], [0, 1]])
    out = collect_informative_groups(draw, lambda s: s[2], group_size=2, target_groups=3, max_rounds=3)
    assert calls == [0, 1, 2]  # the bound, never more
    assert not out.filled and out.groups_kept == 2 and len(out.samples) == 4 and out.prompts_drawn == 6
    none = collect_informative_groups(
        _rounds([[1, 1]], [[0, 0]])[0], lambda s: s[2], group_size=2, target_groups=1, max_rounds=2
    )
    assert none.samples == [] and none.groups_kept == 0 and not none.filled and none.rounds == 2


@pytest.mark.parametrize(
    ("rows", "global_batch", "dp", "expected"),
    [
        (64, 64, 1, (64, 64)),  # a full step
        (64, 16, 2, (64, 16)),
        (40, 16, 1, (32, 16)),  # whole global batches; the rest dropped
        (12, 16, 1, (12, 12)),  # less than one global batch: one optimizer step on all of it
        (12, 16, 8, (8, 8)),  # ... the part that splits over the data-parallel ranks
        (4, 16, 8, (0, 0)),  # nothing trainable
        (0, 16, 1, (0, 0)),
    ],
)
def test_trainable_rows(rows, global_batch, dp, expected):
    assert trainable_rows(rows, global_batch, dp) == expected
