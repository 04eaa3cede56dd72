"""Preference losses: DPO (with conservative label smoothing), IPO and KTO. Pure tensor functions.

Shapes: B sequences (or pairs), T completion positions. Every loss takes log-probabilities of whole
completions, the policy's (with grad) and the frozen reference's, and returns ``(loss, stats)``: a
scalar mean over the B rows given, and float metrics (the loss, its terms, the implicit rewards
``beta * (log p - log ref)``, margins and accuracies). A caller that accumulates gradients over k
micro batches of a batch weighs each micro batch's loss by its share of the batch.

Accuracy counts a tie as half right: before training the policy is the reference, every implicit
reward is 0, and the accuracy reads 0.5, chance, rather than 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def sequence_logprobs(token_logprobs: Tensor, mask: Tensor, *, average: bool = False) -> Tensor:
    """Sum (or, with ``average``, mean) of each row's token log-probs where ``mask`` is 1.

    token_logprobs: [B, T] float. mask: [B, T] bool or 0/1. Returns [B] float32. Padding may hold
    anything, inf and NaN included: it is selected away, never multiplied by 0. A row with no
    tokens sums to 0 (and averages to 0).
    """
    if token_logprobs.shape != mask.shape:
        raise ValueError(
            f"token_logprobs {tuple(token_logprobs.shape)} and mask {tuple(mask.shape)} differ"
        )
    mask = mask.bool()
    total = torch.where(mask, token_logprobs.float(), 0.0).sum(dim=-1)
    return total / mask.sum(dim=-1).clamp(min=1) if average else total


def preference_accuracy(margins: Tensor) -> Tensor:
    """Share of rows with a positive margin, a zero margin counting half. margins: [B] -> []."""
    return ((margins > 0).float() + 0.5 * (margins == 0).float()).mean()


def ranking_accuracy(desirable: Tensor, undesirable: Tensor) -> Tensor:
    """Probability that a desirable score beats an undesirable one, ties counting half (the AUC).

    desirable: [D], undesirable: [U] scores (implicit rewards). Returns [] in [0, 1]; 0.5 when
    either side is empty. Computed from average ranks (Mann-Whitney U), in O((D + U) log(D + U)).
    """
    if desirable.numel() == 0 or undesirable.numel() == 0:
        return torch.tensor(0.5, device=desirable.device)
    scores = torch.cat([desirable, undesirable]).double()
    ranks = _average_ranks(scores)
    d, u = desirable.numel(), undesirable.numel()
    wins = ranks[:d].sum() - d * (d + 1) / 2
    return (wins / (d * u)).float()


def _average_ranks(values: Tensor) -> Tensor:
    """1-based ranks of ``values`` [N]; tied values share the mean of the ranks they span."""
    _, inverse, counts = torch.unique(values, return_inverse=True, return_counts=True)
    last = counts.cumsum(0).double()  # the highest rank each distinct value spans
    return (last - (counts.double() - 1) / 2)[inverse]


def _pair_stats(
    loss: Tensor, chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float
) -> dict[str, float]:
    chosen = beta * chosen_logratios.detach()
    rejected = beta * rejected_logratios.detach()
    margins = chosen - rejected
    values = torch.stack(
        [
            loss.detach(),
            chosen.mean(),
            rejected.mean(),
            margins.mean(),
            preference_accuracy(margins),
        ]
    )
    names = ("loss", "rewards/chosen", "rewards/rejected", "margin", "accuracy")
    return dict(zip(names, values.tolist(), strict=True))


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    reference_chosen: Tensor,
    reference_rejected: Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """DPO, conservative with ``label_smoothing`` (cDPO): each label is flipped with that probability.

    Every argument is [B] sequence log-probs. With h = (pc - rc) - (pr - rr) and e = label_smoothing:
    loss = mean(-(1 - e) * log sigmoid(beta * h) - e * log sigmoid(-beta * h)).
    """
    _same_shapes(policy_chosen, policy_rejected, reference_chosen, reference_rejected)
    chosen_logratios = policy_chosen - reference_chosen
    rejected_logratios = policy_rejected - reference_rejected
    logits = beta * (chosen_logratios - rejected_logratios)
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    loss = losses.mean()
    return loss, _pair_stats(loss, chosen_logratios, rejected_logratios, beta)


def ipo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    reference_chosen: Tensor,
    reference_rejected: Tensor,
    *,
    beta: float,
) -> tuple[Tensor, dict[str, float]]:
    """IPO: regress the log-ratio margin h = (pc - rc) - (pr - rr) onto 1 / (2 beta).

    Every argument is [B] log-probs; pass per-token means (``sequence_logprobs(average=True)``),
    as TRL does on the IPO authors' advice, so that beta does not depend on completion length.
    loss = mean((h - 1 / (2 beta))^2). It does not saturate: the margin is held at 1 / (2 beta).
    """
    _same_shapes(policy_chosen, policy_rejected, reference_chosen, reference_rejected)
    chosen_logratios = policy_chosen - reference_chosen
    rejected_logratios = policy_rejected - reference_rejected
    losses = (chosen_logratios - rejected_logratios - 1 / (2 * beta)).square()
    loss = losses.mean()
    return loss, _pair_stats(loss, chosen_logratios, rejected_logratios, beta)


def kto_reference_point(policy_logprobs: Tensor, reference_logprobs: Tensor) -> Tensor:
    """KTO's reference point z0: the batch's estimate of KL(policy || reference), >= 0, detached.

    policy_logprobs, reference_logprobs: [M] sequence log-probs of mismatched pairs (a prompt with
    another record's completion), as in the KTO paper and TRL. Returns []: the mean log-ratio,
    clamped at 0. Detached: z0 is a baseline, and no gradient flows through it.
    """
    _same_shapes(policy_logprobs, reference_logprobs)
    return (policy_logprobs - reference_logprobs).mean().clamp(min=0).detach()


def kto_loss(
    policy_logprobs: Tensor,
    reference_logprobs: Tensor,
    desirable: Tensor,
    reference_point: Tensor,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, dict[str, float]]:
    """KTO on unpaired completions.

    policy_logprobs, reference_logprobs: [B] sequence log-probs; desirable: [B] bool (the label);
    reference_point: [] z0 from ``kto_reference_point``. With r = policy - reference:
    desirable rows lose w_d * (1 - sigmoid(beta * (r - z0))), undesirable rows
    w_u * (1 - sigmoid(beta * (z0 - r))); the loss is their mean over all B rows.

    Stats: loss, kl (z0), rewards/chosen and rewards/rejected (mean beta * r over the desirable
    and the undesirable rows; 0 when there are none), margin (their difference) and
    accuracy (``ranking_accuracy`` of beta * r between the two).
    """
    _same_shapes(policy_logprobs, reference_logprobs, desirable)
    desirable = desirable.bool()
    logratios = policy_logprobs - reference_logprobs
    z0 = reference_point.detach()
    losses = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (logratios - z0))),
        undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratios))),
    )
    loss = losses.mean()
    rewards = beta * logratios.detach()
    chosen, rejected = rewards[desirable], rewards[~desirable]
    chosen_mean = chosen.mean() if chosen.numel() else rewards.new_zeros(())
    rejected_mean = rejected.mean() if rejected.numel() else rewards.new_zeros(())
    values = torch.stack(
        [
            loss.detach(),
            z0.float(),
            chosen_mean,
            rejected_mean,
            chosen_mean - rejected_mean,
            ranking_accuracy(chosen, rejected).to(rewards.device),
        ]
    )
    names = (
        "loss",
        "kl",
        "rewards/chosen",
        "rewards/rejected",
        "margin",
        "accuracy",
    )
    return loss, dict(zip(names, values.tolist(), strict=True))


def _same_shapes(*tensors: Tensor) -> None:
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(
            f"expected [B] tensors of one shape, got {[tuple(t.shape) for t in tensors]}"
        )
