"""Advantage estimators, against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rollout.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    group_advantages,
    rloo_advantages,
)

# Two groups of four: the first split 2 / 2, the second all solved.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])


def test_group_scale_divides_by_the_groups_unbiased_std():
    # Group 1: mean 0.5, centred ±0.5; unbiased variance (4 × 0.25) / 3 = 1/3, std 1/√3,
    # so ±0.5 × √3 = ±0.866025.
    # Group 2: all equal, centred 0, std 0: advantage 0 / (0 + eps) = 0, not NaN.
    h = 0.5 * math.sqrt(3)
    expected = torch.tensor([h, -h, -h, h, 0.0, 0.0, 0.0, 0.0])
    got = group_advantages(REWARDS, 4, scale="group")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert not got.isnan().any()


def test_group_scale_on_distinct_rewards():
    # [2, 4, 6]: mean 4, centred [-2, 0, 2], unbiased variance 8 / 2 = 4, std 2 → [-1, 0, 1].
    got = group_advantages(torch.tensor([2.0, 4.0, 6.0]), 3, eps=0.0)
    torch.testing.assert_close(got, torch.tensor([-1.0, 0.0, 1.0]))


def test_batch_scale_centres_per_group_and_divides_by_the_batch_std():
    # All eight: mean 0.75; six deviations of 0.25 and two of -0.75:
    # sum of squares 6 × 0.0625 + 2 × 0.5625 = 1.5, unbiased variance 1.5 / 7, std 0.462910.
    # Group 1 centred ±0.5 → ±0.5 / 0.462910 = ±1.080123; group 2 centred 0 → 0.
    a = 0.5 / math.sqrt(1.5 / 7)
    expected = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(
        group_advantages(REWARDS, 4, scale="batch"), expected, rtol=0, atol=1e-5
    )


def test_no_scale_only_centres():
    # Dr. GRPO: reward minus group mean; group 1 mean 0.5, group 2 mean 1.
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(REWARDS, 4, scale="none"), expected)


def test_rloo_baselines_on_the_other_members():
    # r = 1: others (0, 0, 1) average 1/3 → 2/3.  r = 0: others (1, 0, 1) average 2/3 → -2/3.
    # Group 2: every other member is 1 → 0.
    t = 2 / 3
    expected = torch.tensor([t, -t, -t, t, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(rloo_advantages(REWARDS, 4), expected)


def test_rloo_with_pairs():
    # Group of two: each is baselined on the other alone: 3 - 6 = -3, 6 - 3 = 3.
    got = rloo_advantages(torch.tensor([3.0, 6.0, 5.0, 5.0]), 2)
    torch.testing.assert_close(got, torch.tensor([-3.0, 3.0, 0.0, 0.0]))


@st.composite
def grouped_rewards(draw):
    """(rewards [n × G] float64, G) for 1 to 4 groups of 2 to 6."""
    g = draw(st.integers(min_value=2, max_value=6))
    n = draw(st.integers(min_value=1, max_value=4))
    values = draw(
        st.lists(st.floats(min_value=-100, max_value=100), min_size=n * g, max_size=n * g)
    )
    return torch.tensor(values, dtype=torch.float64), g


@given(grouped_rewards())
def test_advantages_sum_to_zero_in_every_group(case):
    rewards, g = case
    for advantages in (group_advantages(rewards, g, scale="none"), rloo_advantages(rewards, g)):
        sums = advantages.view(-1, g).sum(dim=1)
        torch.testing.assert_close(sums, torch.zeros_like(sums), rtol=0, atol=1e-9)


@given(grouped_rewards())
def test_rloo_is_the_centred_reward_scaled_by_g_over_g_minus_1(case):
    # r - (S - r) / (G - 1) = (G r - S) / (G - 1) = G / (G - 1) × (r - S / G).
    rewards, g = case
    torch.testing.assert_close(
        rloo_advantages(rewards, g), g / (g - 1) * group_advantages(rewards, g, scale="none")
    )


def test_registry_shares_one_signature():
    for estimator in ADVANTAGE_ESTIMATORS.values():
        assert estimator(REWARDS, 4).shape == REWARDS.shape
    torch.testing.assert_close(
        ADVANTAGE_ESTIMATORS["grpo"](REWARDS, 4, scale="none"),
        group_advantages(REWARDS, 4, scale="none"),
    )


def test_an_unknown_knob_fails_loudly():
    with pytest.raises(TypeError):
        ADVANTAGE_ESTIMATORS["grpo"](REWARDS, 4, scael="none")
    with pytest.raises(TypeError):
        ADVANTAGE_ESTIMATORS["rloo"](REWARDS, 4, scale="group")


@pytest.mark.parametrize(
    ("rewards", "group_size", "message"),
    [
        (torch.zeros(6), 4, "do not split into groups of 4"),
        (torch.zeros(4), 1, "at least 2"),
        (torch.zeros(2, 4), 4, "1-D"),
    ],
)
def test_bad_layouts_are_refused(rewards, group_size, message):
    for estimator in ADVANTAGE_ESTIMATORS.values():
        with pytest.raises(ValueError, match=message):
            estimator(rewards, group_size)


def test_unknown_scale_is_refused():
    with pytest.raises(ValueError, match="'group', 'batch' or 'none'"):
        group_advantages(REWARDS, 4, scale="std")
