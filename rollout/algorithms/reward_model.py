"""Reward-model training: the Bradley-Terry loss on preference pairs. Pure tensor functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rollout.algorithms.preference import preference_accuracy


def bradley_terry_loss(
    chosen: Tensor, rejected: Tensor, *, center_coef: float | None = None
) -> tuple[Tensor, dict[str, float]]:
    """-log sigmoid(r_chosen - r_rejected), averaged over pairs, plus an optional centring term.

    chosen, rejected: [B] scalar rewards the model gives each pair's two completions (with grad).
    center_coef: weight of mean((r_chosen + r_rejected)^2), which pulls rewards towards 0 without
    changing which completion wins (the loss only sees differences); None or 0 leaves it out.

    Stats: loss, rewards/chosen, rewards/rejected, margin (means) and accuracy
    (pairs ranked right, a tie counting half); center_loss when the term is on.
    """
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(
            f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} must both be [B]"
        )
    margins = chosen.float() - rejected.float()
    loss = -F.logsigmoid(margins).mean()
    terms = {}
    if center_coef:
        center = (chosen.float() + rejected.float()).square().mean()
        loss = loss + center_coef * center
        terms["center_loss"] = center.detach()
    margins = margins.detach()
    values = {
        "loss": loss.detach(),
        "rewards/chosen": chosen.detach().float().mean(),
        "rewards/rejected": rejected.detach().float().mean(),
        "margin": margins.mean(),
        "accuracy": preference_accuracy(margins),
        **terms,
    }
    stacked = torch.stack(list(values.values()))
    return loss, dict(zip(values, stacked.tolist(), strict=True))
