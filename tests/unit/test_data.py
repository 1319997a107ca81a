import pytest

from rlfleet.data.arithmetic import arithmetic_splits, generate_arithmetic
from rlfleet.data.loader import ResumableLoader
from rlfleet.rewards import math_reward

KW = {"min_ops": 1, "max_ops": 3, "max_operand": 20, "operations": ["+", "-", "*"]}


def test_arithmetic_is_seeded_and_well_formed():
    a = generate_arithmetic(200, seed=3, **KW)
    assert a == generate_arithmetic(200, seed=3, **KW)
    assert a != generate_arithmetic(200, seed=4, **KW)
    for ex in a:
        assert ex.answer.endswith(f"#### {ex.gold}")
        assert int(ex.gold) >= 0
        assert math_reward("", ex.answer, ex.gold) == 1.0
        # every equation line is arithmetically right
        for line in ex.answer.splitlines()[:-1]:
            lhs, rhs = line.split(" = ")
            assert eval(lhs) == int(rhs)


def test_splits_do_not_overlap():
    train, val = arithmetic_splits(num_train=500, num_val=100, seed=1, **KW)
    assert len(train) == 500 and len(val) == 100
    assert not {e.question for e in train} & {e.question for e in val}


def test_loader_resume_is_exact_across_epochs():
    items = list(range(10))
    ref = ResumableLoader(items, 3, shuffle=True, seed=7)
    seq = [ref.next_batch() for _ in range(8)]  # 3 batches per epoch: crosses 2 epoch boundaries
    for epoch in (seq[0:3], seq[3:6]):  # 9 distinct items per epoch, the remainder dropped
        flat = [x for batch in epoch for x in batch]
        assert len(set(flat)) == 9 and set(flat) <= set(items)
    assert seq[0:3] != seq[3:6]  # reshuffled per epoch
    for cut in range(8):
        a = ResumableLoader(items, 3, shuffle=True, seed=7)
        for _ in range(cut):
            a.next_batch()
        b = ResumableLoader(items, 3, shuffle=True, seed=7)
        b.load_state_dict(a.state_dict())
        assert [b.next_batch() for _ in range(8 - cut)] == seq[cut:]


def test_loader_epoch_counting_and_errors():
    loader = ResumableLoader(list(range(6)), 3, shuffle=False, seed=0)
    assert loader.next_batch() == [0, 1, 2]
    assert loader.completed_epochs == 0
    loader.next_batch()
    assert loader.completed_epochs == 1
    assert loader.next_batch() == [0, 1, 2]
    with pytest.raises(ValueError, match="fewer than one batch"):
        ResumableLoader([1], 2, shuffle=False, seed=0)
    other = ResumableLoader(list(range(7)), 3, shuffle=False, seed=0)
    with pytest.raises(ValueError, match="num_items"):
        other.load_state_dict(loader.state_dict())
