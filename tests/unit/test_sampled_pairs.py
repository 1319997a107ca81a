"""Pairs from the model's own samples (``rlfleet.rollouts.pairs``): which two samples of a group make the
pair, with the rewards alone and with DPO's overlong shaping (``dpo.sampled_pairs.reward_shaping``)."""

from __future__ import annotations

import pytest

from rlfleet.algorithms.overlong import OverlongShaping
from rlfleet.config.shaping import RewardShapingConfig
from rlfleet.data import Example, Prompt
from rlfleet.generation import GenerationResult
from rlfleet.rollouts.pairs import best_and_worst, best_and_worst_of_groups, sampled_pair
from rlfleet.rollouts.rollout import Rollout

PROMPT = Prompt(Example("What is 2 + 2?", "#### 4", "4"), "What is 2 + 2?", (1, 2, 3))


def sample(reward: float, length: int, first_token: int = 7) -> Rollout:
    tokens = (first_token,) * length
    return Rollout(PROMPT, GenerationResult(tokens, (0.0,) * length, "", length < 10), reward)


# The penalty starts after 6 of 10 tokens and reaches -0.5 at 10.
SHAPING = OverlongShaping.of(
    RewardShapingConfig(enabled=True, overlong_buffer_length=4, overlong_buffer_penalty=0.5), 10
)


def shaped(rollout: Rollout) -> float:
    assert SHAPING is not None
    return SHAPING.score(rollout.reward, rollout.num_response_tokens)


def test_the_best_and_the_worst_reward_make_the_pair_first_of_ties_each() -> None:
    group = [sample(0.0, 3, 1), sample(1.0, 9, 2), sample(1.0, 4, 3), sample(0.0, 5, 4)]
    chosen, rejected = best_and_worst(group) or (None, None)
    assert chosen is group[1] and rejected is group[0]


def test_equal_rewards_give_no_pair_unless_shaping_tells_them_apart() -> None:
    wrong = [sample(0.0, 5), sample(0.0, 10), sample(0.0, 8)]
    assert best_and_worst(wrong) is None
    chosen, rejected = best_and_worst(wrong, shaped) or (None, None)
    assert chosen is wrong[0] and rejected is wrong[1]  # stopped early beats ran into the limit
    short = [sample(0.0, 2), sample(0.0, 6)]  # both before the buffer: the penalty is 0 for each
    assert best_and_worst(short, shaped) is None


def test_shaping_never_outranks_a_correct_answer() -> None:
    """A correct response at the limit (1 - 0.5) still beats a wrong one that stopped early (0)."""
    group = [sample(0.0, 2), sample(1.0, 10)]
    chosen, rejected = best_and_worst(group, shaped) or (None, None)
    assert chosen is group[1] and rejected is group[0]


@pytest.mark.parametrize(
    ("section", "limit", "expected"),
    [
        (RewardShapingConfig(enabled=False), 10, None),
        (RewardShapingConfig(enabled=True, overlong_buffer_length=4), 10, OverlongShaping(10, 4, 1.0)),
        (
            RewardShapingConfig(enabled=True, overlong_buffer_length=4, max_response_length=8),
            10,
            OverlongShaping(8, 4, 1.0),
        ),
    ],
)
def test_the_section_gives_the_penalty_or_none(
    section: RewardShapingConfig, limit: int, expected: OverlongShaping | None
) -> None:
    assert OverlongShaping.of(section, limit) == expected


def test_groups_give_one_pair_each_in_the_sampled_tokens() -> None:
    groups = [
        sample(1.0, 3, 1), sample(0.0, 3, 2),  # a pair
        sample(0.0, 3, 3), sample(0.0, 3, 4),  # no preference
        sample(0.0, 4, 5), sample(0.5, 2, 6),  # a pair, best second
    ]  # fmt: skip
    found = best_and_worst_of_groups(groups, group_size=2)
    assert [(c.result.token_ids[0], r.result.token_ids[0]) for c, r in found] == [(1, 2), (6, 5)]
    pair = sampled_pair(*found[1])
    assert (pair.prompt_ids, pair.chosen_ids, pair.rejected_ids) == ((1, 2, 3), (6, 6), (5, 5, 5, 5))
    assert pair.chosen_mask is None and pair.rejected_mask is None
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        best_and_worst_of_groups(groups, group_size=4)
