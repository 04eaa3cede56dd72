"""Per-token advantages and the value loss against numbers worked out by hand."""

from __future__ import annotations

import pytest
import torch

from rollout.algorithms.advantages import (
    discounted_returns,
    gae,
    kl_shaped_rewards,
    reinforce_pp_advantages,
    whiten,
)
from rollout.algorithms.losses import value_loss

# Row 0 has a 2-token completion (its first column is padding), row 1 a 3-token one.
MASK = torch.tensor([[0, 1, 1], [1, 1, 1]])


def test_kl_shaped_rewards_penalize_every_token_and_pay_at_the_last():
    kl = torch.tensor([[9.0, 0.5, 0.5], [1.0, 1.0, 1.0]])  # the 9 sits on padding: ignored
    shaped = kl_shaped_rewards(torch.tensor([1.0, 2.0]), kl, MASK, kl_coef=0.1)
    expected = torch.tensor([[0.0, -0.05, 0.95], [-0.1, -0.1, 1.9]])
    torch.testing.assert_close(shaped, expected)


def test_kl_shaped_rewards_without_kl():
    shaped = kl_shaped_rewards(torch.tensor([1.0, 2.0]), None, MASK)
    torch.testing.assert_close(shaped, torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 2.0]]))


def test_discounted_returns():
    shaped = torch.tensor([[0.0, -0.05, 0.95], [-0.1, -0.1, 1.9]])
    torch.testing.assert_close(
        discounted_returns(shaped, MASK, gamma=1.0),
        torch.tensor([[0.0, 0.9, 0.95], [1.7, 1.8, 1.9]]),
    )
    torch.testing.assert_close(
        discounted_returns(shaped, MASK, gamma=0.5),
        torch.tensor([[0.0, 0.425, 0.95], [0.325, 0.85, 1.9]]),
    )


def test_gae_by_hand():
    rewards, values, mask = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.8]]), torch.ones(1, 2)
    # t=1: delta = 1 + 0 - 0.8 = 0.2, A = 0.2; t=0: delta = 0 + 0.8 - 0.5 = 0.3, A = 0.3 + 0.5 * 0.2
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(advantages, torch.tensor([[0.4, 0.2]]))
    torch.testing.assert_close(returns, torch.tensor([[0.9, 1.0]]))


def test_gae_with_lambda_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, -0.05, 0.95], [-0.1, -0.1, 1.9]])
    values = torch.tensor([[7.0, 0.3, 0.1], [0.2, 0.4, -0.3]])  # the 7 is padding
    advantages, returns = gae(rewards, values, MASK, gamma=1.0, lam=1.0)
    expected_returns = discounted_returns(rewards, MASK, gamma=1.0)
    torch.testing.assert_close(returns, expected_returns)
    torch.testing.assert_close(advantages, (expected_returns - values) * MASK)


def test_whiten_uses_only_the_masked_entries():
    values = torch.tensor([[100.0, 1.0, 3.0], [5.0, 7.0, 9.0]])
    whitened = whiten(values, MASK)
    std = (40 / 4) ** 0.5  # entries 1, 3, 5, 7, 9: mean 5, squared deviations sum to 40
    assert whitened[0, 0] == 0
    assert whitened[0, 1].item() == pytest.approx((1 - 5) / std, rel=1e-5)
    assert whitened[1, 2].item() == pytest.approx((9 - 5) / std, rel=1e-5)


def test_reinforce_pp_with_a_group_baseline():
    advantages = reinforce_pp_advantages(
        torch.tensor([1.0, 3.0]),
        None,
        torch.ones(2, 1),
        kl_coef=0.0,
        group_size=2,
        baseline="group",
    )
    # group mean 2: rewards -1 and 1, whitened by their std sqrt(2)
    torch.testing.assert_close(advantages, torch.tensor([[-(0.5**0.5)], [0.5**0.5]]))


def test_reinforce_pp_without_a_baseline_is_the_whitened_return():
    rewards, mask = torch.tensor([1.0, 2.0]), MASK
    kl = torch.full((2, 3), 0.5)
    advantages = reinforce_pp_advantages(rewards, kl, mask, kl_coef=0.1)
    returns = discounted_returns(kl_shaped_rewards(rewards, kl, mask, kl_coef=0.1), mask)
    torch.testing.assert_close(advantages, whiten(returns, mask))


def test_value_loss_clipped_by_hand():
    values = torch.tensor([[1.0, 2.0]], requires_grad=True)
    old, returns, mask = torch.tensor([[0.5, 2.0]]), torch.tensor([[2.0, 1.0]]), torch.ones(1, 2)
    loss, stats = value_loss(values, old, returns, mask, clip=0.2)
    # token 0: clipped value 0.7, error 1 against clipped error 1.69 -> 0.845; token 1: 0.5
    assert loss.item() == pytest.approx((0.845 + 0.5) / 2)
    assert stats["value_clip_fraction"].item() == pytest.approx(0.5)
    loss.backward()
    # token 0's loss comes from the clipped value, which no longer depends on V: no gradient
    assert values.grad[0, 0] == 0 and values.grad[0, 1] == pytest.approx(0.5)


def test_value_loss_unclipped():
    values = torch.tensor([[1.0, 2.0]])
    loss, stats = value_loss(values, values, torch.tensor([[2.0, 2.0]]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(0.25)
    assert stats["value_clip_fraction"].item() == 0
