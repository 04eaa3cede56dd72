"""DPO, IPO, KTO, SFT and Bradley-Terry losses, against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rollout.algorithms.preference import (
    dpo_loss,
    ipo_loss,
    kto_loss,
    kto_reference_point,
    preference_accuracy,
    ranking_accuracy,
    sequence_logprobs,
)
from rollout.algorithms.reward_model import bradley_terry_loss
from rollout.algorithms.sft import IGNORE, sft_loss

LN3 = math.log(3)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def softplus(x: float) -> float:
    """-log sigmoid(-x)."""
    return math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# --- sequence log-probs and accuracies -----------------------------------------------------------


def test_sequence_logprobs_sum_and_mean_under_the_mask_ignore_nan_padding():
    token = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, float("-inf"), float("-inf")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(sequence_logprobs(token, mask), t(-3.0, -0.5))
    torch.testing.assert_close(sequence_logprobs(token, mask, average=True), t(-1.5, -0.5))


def test_sequence_logprobs_of_an_empty_row_is_zero():
    got = sequence_logprobs(torch.tensor([[-1.0, -2.0]]), torch.zeros(1, 2), average=True)
    torch.testing.assert_close(got, t(0.0))


def test_preference_accuracy_counts_ties_half():
    assert preference_accuracy(t(1.0, -1.0, 0.0, 2.0)).item() == pytest.approx(2.5 / 4)


def test_ranking_accuracy_is_the_share_of_pairs_won():
    # (1 > 0) + (1 < 2: 0) + (2 > 0) + (2 == 2: 1/2) = 2.5 of 4 pairs.
    assert ranking_accuracy(t(1.0, 2.0), t(0.0, 2.0)).item() == pytest.approx(0.625)
    assert ranking_accuracy(t(0.0, 0.0), t(0.0)).item() == pytest.approx(0.5)
    assert ranking_accuracy(t(), t(1.0)).item() == pytest.approx(0.5)
    assert ranking_accuracy(t(-3.0, -1.0), t(5.0, 4.0, 7.0)).item() == 0.0


# --- DPO -----------------------------------------------------------------------------------------

# Pair 0: h = (-1 - -2) - (-3 - -2) = 2. Pair 1: policy = reference, h = 0.
POLICY_CHOSEN, POLICY_REJECTED = t(-1.0, -4.0), t(-3.0, -5.0)
REFERENCE_CHOSEN, REFERENCE_REJECTED = t(-2.0, -4.0), t(-2.0, -5.0)


def test_dpo_loss_by_hand():
    loss, stats = dpo_loss(
        POLICY_CHOSEN, POLICY_REJECTED, REFERENCE_CHOSEN, REFERENCE_REJECTED, beta=0.5
    )
    # beta * h = 1 and 0: -log sigmoid(1) = softplus(-1), -log sigmoid(0) = ln 2.
    expected = (softplus(-1.0) + math.log(2)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["loss"] == pytest.approx(expected, rel=1e-6)
    assert stats["rewards/chosen"] == pytest.approx((0.5 * 1 + 0) / 2)
    assert stats["rewards/rejected"] == pytest.approx((0.5 * -1 + 0) / 2)
    assert stats["margin"] == pytest.approx(0.5)
    assert stats["accuracy"] == pytest.approx(0.75)  # one right, one tie


def test_conservative_dpo_mixes_in_the_flipped_label():
    loss, _ = dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5, label_smoothing=0.2)
    expected = 0.8 * softplus(-1.0) + 0.2 * softplus(1.0)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_dpo_gradient_by_hand():
    # d/d pc of -log sigmoid(beta * h) = -beta * (1 - sigmoid(beta * h)); d/d pr is its negative.
    chosen = t(-1.0).requires_grad_()
    rejected = t(-3.0).requires_grad_()
    loss, _ = dpo_loss(chosen, rejected, t(-2.0), t(-2.0), beta=0.5)
    loss.backward()
    expected = -0.5 * (1 - sigmoid(1.0))
    assert chosen.grad.item() == pytest.approx(expected, rel=1e-6)
    assert rejected.grad.item() == pytest.approx(-expected, rel=1e-6)


def test_dpo_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="one shape"):
        dpo_loss(t(1.0, 2.0), t(1.0), t(1.0), t(1.0), beta=0.1)


# --- IPO -----------------------------------------------------------------------------------------


def test_ipo_loss_by_hand():
    # h = 2 and 0; 1 / (2 beta) = 1 at beta 0.5: ((2 - 1)^2 + (0 - 1)^2) / 2 = 1.
    loss, stats = ipo_loss(
        POLICY_CHOSEN, POLICY_REJECTED, REFERENCE_CHOSEN, REFERENCE_REJECTED, beta=0.5
    )
    assert loss.item() == pytest.approx(1.0)
    assert stats["margin"] == pytest.approx(0.5)
    # At beta 0.25 the target margin is 2, which pair 0 hits exactly: (0 + 4) / 2.
    loss, _ = ipo_loss(
        POLICY_CHOSEN, POLICY_REJECTED, REFERENCE_CHOSEN, REFERENCE_REJECTED, beta=0.25
    )
    assert loss.item() == pytest.approx(2.0)


# --- KTO -----------------------------------------------------------------------------------------


def test_kto_reference_point_is_the_mean_log_ratio_clamped_at_zero():
    assert kto_reference_point(t(-1.0, -1.0), t(-2.0, -3.0)).item() == pytest.approx(1.5)
    assert kto_reference_point(t(-3.0, -3.0), t(-2.0, -1.0)).item() == 0.0
    policy = t(-1.0, -1.0).requires_grad_()
    assert not kto_reference_point(policy, t(-2.0, -3.0)).requires_grad


def test_kto_loss_by_hand():
    # r = [1, -1]; z0 = 0.5, beta = 1. Desirable: 2 * (1 - sigmoid(0.5)); undesirable:
    # 1 * (1 - sigmoid(0.5 - -1)); the mean of the two.
    loss, stats = kto_loss(
        t(-1.0, -2.0),
        t(-2.0, -1.0),
        torch.tensor([True, False]),
        torch.tensor(0.5),
        beta=1.0,
        desirable_weight=2.0,
        undesirable_weight=1.0,
    )
    expected = (2 * (1 - sigmoid(0.5)) + (1 - sigmoid(1.5))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["kl"] == pytest.approx(0.5)
    assert stats["rewards/chosen"] == pytest.approx(1.0)
    assert stats["rewards/rejected"] == pytest.approx(-1.0)
    assert stats["margin"] == pytest.approx(2.0)
    assert stats["accuracy"] == pytest.approx(1.0)


def test_kto_gradient_does_not_flow_into_the_reference_point():
    policy = t(-1.0).requires_grad_()
    z0 = torch.tensor(0.5, requires_grad=True)
    loss, _ = kto_loss(policy, t(-2.0), torch.tensor([True]), z0, beta=1.0)
    loss.backward()
    # d/dr (1 - sigmoid(r - z0)) = -sigmoid'(0.5) = -sigmoid(0.5) * (1 - sigmoid(0.5)).
    assert policy.grad.item() == pytest.approx(-sigmoid(0.5) * (1 - sigmoid(0.5)), rel=1e-6)
    assert z0.grad is None


def test_kto_with_only_desirable_rows_reports_zero_for_the_missing_side():
    _, stats = kto_loss(t(-1.0), t(-1.0), torch.tensor([True]), torch.tensor(0.0), beta=0.1)
    assert stats["rewards/rejected"] == 0.0
    assert stats["accuracy"] == 0.5


# --- SFT -----------------------------------------------------------------------------------------


def test_sft_loss_by_hand_ignores_unlabelled_positions():
    # Position 0: softmax [1/4, 3/4], target 1. Position 2: uniform, target 0. Position 1: ignored.
    logits = torch.tensor([[[0.0, LN3], [LN3, 0.0], [0.0, 0.0]]])
    labels = torch.tensor([[1, IGNORE, 0]])
    total = -math.log(3 / 4) - math.log(1 / 2)
    loss, stats = sft_loss(logits, labels)
    assert loss.item() == pytest.approx(total / 2, rel=1e-6)
    assert stats == {"loss": pytest.approx(total / 2, rel=1e-6), "tokens": 2.0}
    loss, _ = sft_loss(logits, labels, num_tokens=4)
    assert loss.item() == pytest.approx(total / 4, rel=1e-6)


def test_sft_micro_batches_add_up_to_the_batch_token_mean():
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7)
    labels = torch.randint(0, 7, (4, 5))
    labels[0, :3] = IGNORE
    labels[2, 1:] = IGNORE
    whole, _ = sft_loss(logits, labels)
    tokens = int((labels != IGNORE).sum())
    parts = sum(
        sft_loss(logits[i : i + 2], labels[i : i + 2], num_tokens=tokens)[0] for i in (0, 2)
    )
    torch.testing.assert_close(parts, whole)


def test_sft_loss_without_labels_is_zero():
    loss, stats = sft_loss(torch.zeros(1, 2, 3), torch.full((1, 2), IGNORE))
    assert loss.item() == 0.0 and stats["tokens"] == 0.0


# --- Bradley-Terry -------------------------------------------------------------------------------


def test_bradley_terry_by_hand():
    loss, stats = bradley_terry_loss(t(2.0, 0.0), t(0.0, 0.0))
    expected = (softplus(-2.0) + math.log(2)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["accuracy"] == pytest.approx(0.75)
    assert stats["margin"] == pytest.approx(1.0)
    assert stats["rewards/chosen"] == pytest.approx(1.0)
    assert "center_loss" not in stats


def test_bradley_terry_centring_term():
    # mean((2 + 0)^2, (0 + 0)^2) = 2, weighed 0.1.
    loss, stats = bradley_terry_loss(t(2.0, 0.0), t(0.0, 0.0), center_coef=0.1)
    assert loss.item() == pytest.approx((softplus(-2.0) + math.log(2)) / 2 + 0.2, rel=1e-6)
    assert stats["center_loss"] == pytest.approx(2.0)


def test_bradley_terry_gradient_by_hand():
    chosen = t(1.0).requires_grad_()
    rejected = t(0.0).requires_grad_()
    bradley_terry_loss(chosen, rejected)[0].backward()
    assert chosen.grad.item() == pytest.approx(-(1 - sigmoid(1.0)), rel=1e-6)
    assert rejected.grad.item() == pytest.approx(1 - sigmoid(1.0), rel=1e-6)
