"""Losses, KL estimators and aggregations, against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rollout.algorithms.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    aggregate,
    clipped_policy_loss,
    entropy_from_logits,
    grpo_loss,
    kl_penalty,
    masked_mean,
    read_metrics,
    token_logprobs,
)

LN2, LN3 = math.log(2), math.log(3)

# ---------------------------------------------------------------------------------------------
# token_logprobs and entropy_from_logits


def test_token_logprobs_by_hand():
    # logits [0, ln 3]: softmax [1/4, 3/4]. Row 0 picks token 1, row 1 token 0.
    logits = torch.tensor([[[0.0, LN3]], [[0.0, LN3]]])
    got = token_logprobs(logits, torch.tensor([[1], [0]]))
    torch.testing.assert_close(got, torch.tensor([[math.log(3 / 4)], [math.log(1 / 4)]]))


def test_token_logprobs_divides_by_the_temperature():
    # [0, 2 ln 3] / 2 = [0, ln 3]: the same [1/4, 3/4] as above.
    logits = torch.tensor([[[0.0, 2 * LN3]]])
    got = token_logprobs(logits, torch.tensor([[1]]), temperature=2.0)
    torch.testing.assert_close(got, torch.tensor([[math.log(3 / 4)]]))


def test_token_logprobs_matches_log_softmax_in_float32_for_bfloat16_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11).to(torch.bfloat16)
    tokens = torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(-1, tokens[..., None])[..., 0]
    got = token_logprobs(logits, tokens, temperature=0.7)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected)


def test_token_logprobs_gradient_is_one_hot_minus_softmax():
    # d log p(k) / d z = onehot(k) - softmax(z): [0, 1] - [1/4, 3/4] = [-1/4, 1/4].
    logits = torch.tensor([[[0.0, LN3]]], requires_grad=True)
    token_logprobs(logits, torch.tensor([[1]])).sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[[-0.25, 0.25]]]))


def test_entropy_by_hand():
    # Uniform over 4: ln 4. [0, ln 3] (p = 1/4, 3/4): -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335.
    uniform = entropy_from_logits(torch.full((1, 1, 4), 7.0))
    torch.testing.assert_close(uniform, torch.tensor([[math.log(4)]]))
    skewed = entropy_from_logits(torch.tensor([[[0.0, LN3]]]))
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(skewed, torch.tensor([[expected]]))


def test_a_bad_temperature_is_refused():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), temperature=0)


# ---------------------------------------------------------------------------------------------
# KL estimators


def test_kl_estimators_by_hand():
    # p = 1/2, ref = 1/4, so r = ref / p = 1/2 and log r = -ln 2.
    # k1 = -log r = ln 2 = 0.693147; k2 = (ln 2)^2 / 2 = 0.240227; k3 = r - 1 - log r = 0.193147.
    p, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    expected = {"k1": LN2, "k2": LN2**2 / 2, "k3": 0.5 - 1 + LN2}
    for estimator, value in expected.items():
        torch.testing.assert_close(kl_penalty(p, ref, estimator), torch.tensor([[value]]))


@given(
    st.floats(min_value=-30, max_value=0, width=32), st.floats(min_value=-30, max_value=0, width=32)
)
def test_k3_is_never_negative(logp, ref):
    assert kl_penalty(torch.tensor([[logp]]), torch.tensor([[ref]]), "k3").item() >= 0


def test_k3_stays_non_negative_where_rounding_bites():
    # exp(3e-8) rounds to 1 in float32 and 1 - 3e-8 rounds below it, so exp(d) - d - 1 would
    # give -6e-8 here.
    p = torch.zeros(1, 2)
    ref = torch.tensor([[3e-8, 5e-8]])
    assert (kl_penalty(p, ref, "k3") >= 0).all()


def test_every_estimator_is_zero_when_the_policies_agree():
    logprobs = torch.log(torch.tensor([[0.1, 0.5, 0.9]]))
    for estimator in KL_ESTIMATORS:
        assert (kl_penalty(logprobs, logprobs.clone(), estimator) == 0).all()


def test_an_unknown_estimator_names_the_choices():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ---------------------------------------------------------------------------------------------
# the clipped objective


def _one_token_each(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [B, 1] with grad, old_logprobs [B, 1]) giving these ratios."""
    logprobs = torch.tensor([[math.log(r)] for r in ratios], requires_grad=True)
    return logprobs, torch.zeros(len(ratios), 1)


def test_clipping_on_both_sides_of_the_band_with_both_signs():
    # Band [0.8, 1.2]. Loss = -min(r A, clip(r) A); gradient d/dlogp = -A r unless clipped, 0 if so.
    #   r 1.5, A +1: min(1.5, 1.2) = 1.2 (clipped high)  → loss -1.2, grad 0
    #   r 1.5, A -1: min(-1.5, -1.2) = -1.5              → loss  1.5, grad  1.5
    #   r 0.5, A +1: min(0.5, 0.8) = 0.5                 → loss -0.5, grad -0.5
    #   r 0.5, A -1: min(-0.5, -0.8) = -0.8 (clipped low) → loss  0.8, grad 0
    #   r 1.1, A +2: inside the band: 2.2                → loss -2.2, grad -2.2
    logprobs, old = _one_token_each([1.5, 1.5, 0.5, 0.5, 1.1])
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0])
    loss, stats = clipped_policy_loss(logprobs, old, advantages, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.2], [1.5], [-0.5], [0.8], [-2.2]]))
    torch.testing.assert_close(stats.clipped_high, torch.tensor([[1.0], [0], [0], [0], [0]]))
    torch.testing.assert_close(stats.clipped_low, torch.tensor([[0.0], [0], [0], [1], [0]]))
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0], [1.5], [-0.5], [0.0], [-2.2]]))


def test_clip_higher_widens_only_the_upper_side():
    # r 1.25, A +1: inside [0.8, 1.28] → loss -1.25; with the symmetric band it is clipped to -1.2.
    logprobs, old = _one_token_each([1.25])
    advantages = torch.tensor([1.0])
    wide, _ = clipped_policy_loss(logprobs, old, advantages, clip_low=0.2, clip_high=0.28)
    narrow, _ = clipped_policy_loss(logprobs, old, advantages, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(wide, torch.tensor([[-1.25]]))
    torch.testing.assert_close(narrow, torch.tensor([[-1.2]]))


def test_stats_ratio_and_approx_kl():
    # KL(old || new) by k3 with x ~ old: r - 1 - ln r.
    # r 1.5: 0.5 - ln 1.5 = 0.094535.  r 0.5: -0.5 + ln 2 = 0.193147.  r 1: 0.
    logprobs, old = _one_token_each([1.5, 0.5, 1.0])
    _, stats = clipped_policy_loss(logprobs, old, torch.ones(3), clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(stats.ratio, torch.tensor([[1.5], [0.5], [1.0]]))
    expected_kl = torch.tensor([[0.5 - math.log(1.5)], [-0.5 + LN2], [0.0]])
    torch.testing.assert_close(stats.approx_kl, expected_kl)
    assert not stats.ratio.requires_grad


def test_sequence_advantages_broadcast_over_positions_even_when_b_equals_t():
    # B = T = 2: A [1, -1] must mean "row 0 gets 1 at every position", never "column 0 gets 1".
    logprobs = torch.zeros(2, 2)
    loss, _ = clipped_policy_loss(logprobs, logprobs, torch.tensor([1.0, -1.0]), 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.0, -1.0], [1.0, 1.0]]))
    per_token, _ = clipped_policy_loss(logprobs, logprobs, torch.tensor([[1.0, 2.0]] * 2), 0.2, 0.2)
    torch.testing.assert_close(per_token, torch.tensor([[-1.0, -2.0], [-1.0, -2.0]]))


# ---------------------------------------------------------------------------------------------
# aggregation

# Two sequences, three tokens and one; 99 and NaN sit in the padding and must never count.
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, math.nan, 99.0, 99.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "counts", "expected"),
    [
        ("token_mean", {}, 2.5),  # (1 + 2 + 3 + 4) / 4 tokens
        ("sequence_mean", {}, 3.0),  # mean of 6 / 3 = 2 and 4 / 1 = 4
        ("batch_token_mean", {"total_tokens": 8}, 1.25),  # 10 / 8 tokens in the whole batch
        ("constant", {"max_new_tokens": 4}, 1.25),  # 10 / (2 sequences × 4)
        ("constant", {"max_new_tokens": 4, "num_sequences": 5}, 0.5),  # 10 / (5 × 4)
    ],
)
def test_aggregations_on_a_ragged_mask(mode, counts, expected):
    torch.testing.assert_close(aggregate(PER_TOKEN, MASK, mode, **counts), torch.tensor(expected))


def test_boolean_and_float_masks_agree():
    for mode in ("token_mean", "sequence_mean"):
        assert aggregate(PER_TOKEN, MASK.bool(), mode) == aggregate(PER_TOKEN, MASK.float(), mode)


def test_empty_masks_give_zero_not_nan():
    empty = torch.zeros(2, 4)
    assert masked_mean(PER_TOKEN, empty) == 0
    assert aggregate(PER_TOKEN, empty, "sequence_mean") == 0


def _ragged_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """per_token [6, 5] and a mask of completion lengths 5, 1, 3, 4, 2, 5."""
    generator = torch.Generator().manual_seed(seed)
    per_token = torch.randn(6, 5, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5])
    return per_token, (torch.arange(5) < lengths[:, None]).long()


def test_batch_token_mean_micro_batches_add_up_to_the_full_batch_token_mean():
    per_token, mask = _ragged_batch()
    total_tokens = int(mask.sum())  # 20
    pieces = [
        aggregate(
            per_token[i : i + 2], mask[i : i + 2], "batch_token_mean", total_tokens=total_tokens
        )
        for i in range(0, 6, 2)
    ]
    torch.testing.assert_close(sum(pieces), aggregate(per_token, mask, "token_mean"))


def test_constant_micro_batches_add_up_when_given_the_batch_sequence_count():
    per_token, mask = _ragged_batch()
    counts = {"max_new_tokens": 5, "num_sequences": 6}
    pieces = [
        aggregate(per_token[i : i + 3], mask[i : i + 3], "constant", **counts) for i in (0, 3)
    ]
    torch.testing.assert_close(sum(pieces), aggregate(per_token, mask, "constant", **counts))


@pytest.mark.parametrize(
    ("mode", "message"),
    [("batch_token_mean", "needs total_tokens"), ("constant", "needs max_new_tokens")],
)
def test_missing_counts_are_refused(mode, message):
    with pytest.raises(ValueError, match=message):
        aggregate(PER_TOKEN, MASK, mode)


def test_aggregation_refuses_unknown_modes_and_mismatched_shapes():
    with pytest.raises(ValueError, match="token_mean, sequence_mean, batch_token_mean, constant"):
        aggregate(PER_TOKEN, MASK, "mean")
    with pytest.raises(ValueError, match="differ"):
        aggregate(PER_TOKEN, MASK[:, :3], "token_mean")


def test_every_aggregation_takes_the_same_arguments():
    counts = {"total_tokens": 4, "max_new_tokens": 4, "num_sequences": 2}
    for aggregation in LOSS_AGGREGATIONS.values():
        assert aggregation(PER_TOKEN, MASK, **counts).isfinite()


# ---------------------------------------------------------------------------------------------
# grpo_loss


def test_grpo_loss_by_hand():
    # On-policy (ratio 1), so the policy loss per token is -A: row 0 -1, -1; row 1 +2 (one token).
    # token_mean: (-1 - 1 + 2) / 3 = 0. The reference gives every token half the probability:
    # r = 1/2, k3 = r - 1 - ln r = 0.193147; loss = 0 + 0.1 × 0.193147 = 0.0193147.
    logprobs = torch.log(torch.tensor([[0.5, 0.25], [0.8, 0.3]]))
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = grpo_loss(
        logprobs,
        logprobs.clone(),
        torch.tensor([1.0, -2.0]),
        mask,
        clip_low=0.2,
        clip_high=0.2,
        ref_logprobs=logprobs + math.log(0.5),
        kl_coef=0.1,
        entropy=torch.tensor([[1.0, 2.0], [3.0, 100.0]]),
    )
    k3 = 0.5 - 1 + LN2
    torch.testing.assert_close(loss, torch.tensor(0.1 * k3))
    assert read_metrics(metrics) == pytest.approx(
        {
            "policy_loss": 0.0,
            "ratio_mean": 1.0,
            "clip_fraction": 0.0,
            "clip_fraction_low": 0.0,
            "clip_fraction_high": 0.0,
            "approx_kl": 0.0,
            "kl": k3,
            "entropy": 2.0,  # (1 + 2 + 3) / 3; the 100 is padding
        },
        abs=1e-6,
    )


def test_grpo_loss_clip_fraction_counts_masked_tokens_only():
    # Tokens: ratio 1.5 with A +1 (clipped high), ratio 1, and a clipped token in the padding.
    logprobs = torch.log(torch.tensor([[1.5, 1.0, 1.5]]))
    _, metrics = grpo_loss(
        logprobs,
        torch.zeros(1, 3),
        torch.tensor([1.0]),
        torch.tensor([[1, 1, 0]]),
        clip_low=0.2,
        clip_high=0.2,
    )
    assert metrics["clip_fraction"].item() == pytest.approx(0.5)
    assert metrics["clip_fraction_high"].item() == pytest.approx(0.5)
    assert "kl" not in metrics and "entropy" not in metrics


def test_grpo_loss_needs_a_reference_for_a_kl_penalty():
    logprobs = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(
            logprobs,
            logprobs,
            torch.ones(1),
            torch.ones(1, 2),
            clip_low=0.2,
            clip_high=0.2,
            kl_coef=0.1,
        )


@pytest.mark.parametrize("aggregation", sorted(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("kl_estimator", sorted(KL_ESTIMATORS))
def test_gradients_are_finite_and_zero_on_padding(aggregation, kl_estimator):
    torch.manual_seed(0)
    shape = (4, 6)
    logits = torch.randn(*shape, 7, requires_grad=True)
    tokens = torch.randint(0, 7, shape)
    logprobs = token_logprobs(logits, tokens)
    old_logprobs = (logprobs + 0.3 * torch.randn(shape)).detach()
    ref_logprobs = (logprobs + 0.3 * torch.randn(shape)).detach()
    # Completion lengths 6, 1, 3 and 0 (a row with nothing to learn from must not give NaN).
    mask = (torch.arange(6) < torch.tensor([[6], [1], [3], [0]])).long()
    loss, _ = grpo_loss(
        logprobs,
        old_logprobs,
        torch.tensor([1.0, -0.5, 2.0, -1.0]),
        mask,
        clip_low=0.2,
        clip_high=0.28,
        aggregation=aggregation,
        ref_logprobs=ref_logprobs,
        kl_coef=0.05,
        kl_estimator=kl_estimator,
        total_tokens=int(mask.sum()),
        max_new_tokens=6,
    )
    loss.backward()
    assert logits.grad.isfinite().all()
    assert (logits.grad[mask == 0] == 0).all()
    assert (logits.grad[mask == 1] != 0).any()
