import pytest
import torch

from rlfleet.algorithms.advantages import group_advantages, zero_variance_fraction


def test_leave_one_out_baseline_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])  # one group of 4
    adv = group_advantages(rewards, 4, leave_one_out=True, normalize=False)
    # baseline of sample 0 = mean(0, 0, 1) = 1/3 -> 1 - 1/3
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    torch.testing.assert_close(adv, expected)


def test_group_mean_baseline_and_std_normalisation():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = group_advantages(rewards, 4, leave_one_out=False, normalize=True)
    std = rewards.std()
    expected = (rewards - 0.25) / (std + 1e-6)
    torch.testing.assert_close(adv, expected)


def test_all_equal_groups_give_exactly_zero():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.3])
    for loo in (True, False):
        for norm in (True, False):
            adv = group_advantages(rewards, 3, leave_one_out=loo, normalize=norm)
            assert torch.equal(adv, torch.zeros(9))


def test_groups_are_independent():
    rewards = torch.tensor([1.0, 0.0, 5.0, 5.0])
    adv = group_advantages(rewards, 2, leave_one_out=True, normalize=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), 3, leave_one_out=False, normalize=False)
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.zeros(4), 1, leave_one_out=True, normalize=False)


def test_zero_variance_fraction():
    assert zero_variance_fraction(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2) == 0.5
