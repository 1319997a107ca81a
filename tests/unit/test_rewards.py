import pytest

from rlfleet.rewards import extract_answer, load_reward_fn, math_reward


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3 + 4 = 7\n#### 7", "7"),
        ("#### 1,080", "1080"),
        ("so the answer is \\boxed{42}.", "42"),
        ("I think 12 then 15", "15"),
        ("#### -3", "-3"),
        ("#### $18", "18"),
        ("#### 2.50", "2.50"),
        ("no numbers here", None),
        ("first #### 5 then #### 6", "6"),
        ("\\boxed{3} but #### 4", "4"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_math_reward_is_binary_and_numeric():
    assert math_reward("p", "4 + 4 = 8\n#### 8", "8") == 1.0
    assert math_reward("p", "#### 8.0", "8") == 1.0
    assert math_reward("p", "#### 1,080", "1080") == 1.0
    assert math_reward("p", "#### 1080", "1,080") == 1.0
    assert math_reward("p", "#### 9", "8") == 0.0
    assert math_reward("p", "nothing", "8") == 0.0
    assert math_reward("p", "#### 8", "not a number") == 0.0


def test_huge_response_is_bounded():
    assert math_reward("p", "x" * 2_000_000 + " #### 5", "5") == 1.0


def test_load_reward_fn():
    assert load_reward_fn("rlfleet.rewards.math_reward") is math_reward
    with pytest.raises(ValueError, match="cannot import"):
        load_reward_fn("rlfleet.rewards.nope")
    with pytest.raises(ValueError, match="dotted path"):
        load_reward_fn("nodots")
