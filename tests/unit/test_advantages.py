import pytest
import torch

from rlfleet.algorithms.grpo.advantages import (
    baseline_and_std,
    group_advantages,
    signal_metrics,
    zero_variance_fraction,
)


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


def test_leave_one_out_std_is_the_others_std_as_nemo_rl():
    """A lone success among failures: its three peers have no spread, so it keeps its raw advantage; each
    failure is divided by the unbiased std of {1, 0, 0}."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = group_advantages(rewards, 4, leave_one_out=True, normalize=True)
    others_std = torch.tensor([1.0, 0.0, 0.0]).std()
    expected = torch.tensor([1.0, *(3 * [(-1 / 3) / (float(others_std) + 1e-6)])])
    torch.testing.assert_close(adv, expected)
    assert abs(float(adv.sum())) > 0.5  # no zero sum under the leave-one-out std


def test_group_std_option_keeps_one_scale_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 0.0, 1.0, 1.0])
    adv = group_advantages(rewards, 4, leave_one_out=True, normalize=True, std_over="group")
    raw = group_advantages(rewards, 4, leave_one_out=True, normalize=False)
    stds = rewards.reshape(2, 4).std(dim=1).repeat_interleave(4)
    torch.testing.assert_close(adv, raw / (stds + 1e-6))
    torch.testing.assert_close(adv.reshape(2, 4).sum(dim=1), torch.zeros(2), atol=1e-6, rtol=0)


def test_leave_one_out_std_of_equal_others_is_exactly_zero():
    """Others that are all 0.1 have std 0 exactly (not a rounding residue that a division would blow up)."""
    rewards = torch.tensor([0.7, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])
    baseline, std = baseline_and_std(rewards, 8, leave_one_out=True)
    assert std[0] == 0.0 and (std[1:] > 0).all()
    adv = group_advantages(rewards, 8, leave_one_out=True, normalize=True)
    torch.testing.assert_close(adv[0], rewards[0] - baseline[0])


def test_without_leave_one_out_both_std_choices_agree():
    rewards = torch.rand(12, generator=torch.Generator().manual_seed(0))
    a = group_advantages(rewards, 4, leave_one_out=False, normalize=True, std_over="baseline_samples")
    b = group_advantages(rewards, 4, leave_one_out=False, normalize=True, std_over="group")
    assert torch.equal(a, b)


def test_shaped_rewards_blow_up_the_leave_one_out_std_and_the_group_std_bounds_them():
    """The overlong penalty makes rewards continuous. A truncated sample (-0.5) whose seven peers nearly
    agree (six 0.0, one a token into the buffer, -1/128) is divided by the peers' tiny std: |A| ~ 350.
    Seen in a SmolLM2 run (loss 6.9, grad norm 32 on one step). The whole group's std bounds every
    advantage by sqrt(G) (a sample's z-score in a group of G is at most (G-1)/sqrt(G), times G/(G-1) for
    the leave-one-out baseline)."""
    rewards = torch.tensor([-0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1 / 128])
    loo = group_advantages(rewards, 8, leave_one_out=True, normalize=True)
    assert loo[0] < -100
    group = group_advantages(rewards, 8, leave_one_out=True, normalize=True, std_over="group")
    assert group.abs().max() <= 8**0.5
    extreme = torch.tensor([1.0] + [0.0] * 7)  # the bound is reached by a lone outlier
    edge = group_advantages(extreme, 8, leave_one_out=True, normalize=True, std_over="group")
    torch.testing.assert_close(edge[0], torch.tensor(8**0.5), atol=1e-4, rtol=0)
    noisy = torch.rand(64, generator=torch.Generator().manual_seed(1)) ** 8  # many near-ties
    bounded = group_advantages(noisy, 8, leave_one_out=True, normalize=True, std_over="group")
    assert bounded.abs().max() <= 8**0.5


def test_signal_metrics_say_which_groups_the_advantages_come_from():
    """Two groups of 4: one all wrong whose overlong penalties differ slightly, one with a right answer.
    Normalised by each group's std, the all-wrong group weighs as much as the other; without the std its
    share is what its reward differences are."""
    correct = torch.tensor([False, False, False, False, True, False, False, False])
    rewards = torch.tensor([0.0, -0.02, -0.01, 0.0, 1.0, 0.0, 0.0, 0.0])
    normalised = group_advantages(rewards, 4, leave_one_out=False, normalize=True, std_over="group")
    raw = group_advantages(rewards, 4, leave_one_out=False, normalize=False)
    by_std = signal_metrics(correct, normalised, 4)
    assert by_std["correctness_signal_groups"] == 0.5
    assert by_std["advantage_share_without_correct"] == pytest.approx(0.5, abs=0.05)
    plain = signal_metrics(correct, raw, 4)
    assert plain["advantage_share_without_correct"] == pytest.approx(0.03 / (0.03 + 1.5), rel=1e-4)
    nothing = signal_metrics(correct, torch.zeros(8), 4)
    assert nothing == {"correctness_signal_groups": 0.5, "advantage_share_without_correct": 0.0}
