"""Group-relative advantages against hand-computed values."""

import math

import pytest
import torch

from algos import group_advantages, zero_std_group_frac


def test_group_advantages_on_a_known_batch():
    # Group 1: mean 0.25, unbiased std sqrt((0.75² + 3·0.25²)/3) = 0.5.
    # Group 2: mean 0.5, unbiased std sqrt(4·0.25/3) = 1/sqrt(3).
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    s = math.sqrt(3) / 2
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, s, s, -s, -s])
    torch.testing.assert_close(group_advantages(rewards, group_size=4), expected, rtol=1e-5, atol=1e-5)


def test_pairs_get_plus_minus_one_over_sqrt_two():
    advantages = group_advantages(torch.tensor([0.0, 1.0, 3.0, 1.0]), group_size=2, eps=1e-12)
    expected = torch.tensor([-1.0, 1.0, 1.0, -1.0]) / math.sqrt(2)
    torch.testing.assert_close(advantages, expected)


def test_without_std_scaling_advantages_are_reward_minus_group_mean():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
    assert torch.equal(group_advantages(rewards, group_size=4, scale_by_std=False), expected)


def test_a_group_with_equal_rewards_gets_zero_advantages():
    rewards = torch.tensor([1, 1, 1, 0, 0, 0, 2, 0, 1])  # integer rewards are accepted
    for scale_by_std in (True, False):
        advantages = group_advantages(rewards, group_size=3, scale_by_std=scale_by_std)
        assert advantages.dtype == torch.float32
        assert torch.equal(advantages[:6], torch.zeros(6))
        assert advantages[6:].abs().sum() > 0


def test_zero_std_group_fraction():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert zero_std_group_frac(rewards, group_size=4) == pytest.approx(2 / 3)
    assert zero_std_group_frac(torch.tensor([0.0, 1.0]), group_size=2) == 0.0


@pytest.mark.parametrize(
    "rewards, group_size, message",
    [
        (torch.zeros(7), 4, "N = 7 is not divisible by group_size = 4"),
        (torch.zeros(4), 1, "group_size must be an int >= 2.*got 1"),
        (torch.zeros(4), 0, "group_size must be an int >= 2.*got 0"),
        (torch.zeros(4), 2.0, "group_size must be an int >= 2.*got 2.0"),
        (torch.zeros(2, 4), 4, r"rewards must be a non-empty 1-D tensor \[N\], got \(2, 4\)"),
        (torch.zeros(0), 4, "rewards must be a non-empty 1-D tensor"),
    ],
)
def test_bad_layouts_are_rejected(rewards, group_size, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, group_size)
    with pytest.raises(ValueError, match=message):
        zero_std_group_frac(rewards, group_size)


def test_eps_must_be_positive():
    with pytest.raises(ValueError, match="eps must be > 0"):
        group_advantages(torch.zeros(4), group_size=2, eps=0.0)
