"""Advantages from sequence rewards: pure tensor functions, one signature per estimator.

Shapes: B completions, laid out as B / G groups of G completions of the same prompt, contiguous:
group g is ``rewards[g * G : (g + 1) * G]``.

Every estimator is called as ``fn(rewards [B], group_size, **knobs) -> advantages [B]``. Knobs are
keyword-only and each estimator names the ones it takes, so a misspelled knob is a TypeError
rather than a setting silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from torch import Tensor

RewardScale = Literal["group", "batch", "none"]

# (rewards [B], group_size, **knobs) -> advantages [B]
AdvantageFn = Callable[..., Tensor]


def group_advantages(
    rewards: Tensor, group_size: int, *, scale: RewardScale = "group", eps: float = 1e-6
) -> Tensor:
    """GRPO: each reward minus its group's mean, divided by a standard deviation.

    rewards: [B] float. Returns [B], same dtype.

    scale: "group" divides by the group's std, "batch" by the std of all B rewards (the group
    mean is still subtracted), "none" does not divide (Dr. GRPO, which argues the division
    over-weights prompts that are nearly always or never solved).

    The std is the unbiased (Bessel-corrected) one, as torch.std, TRL and verl compute it, so
    advantages are comparable with theirs. ``eps`` keeps a group whose rewards are all equal at
    advantage 0 (its centred rewards are all 0) instead of 0 / 0.
    """
    grouped = _grouped(rewards, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred.flatten()
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True)
    elif scale == "batch":
        std = rewards.std()
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return (centred / (std + eps)).flatten()


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out: each reward minus the mean reward of the other G - 1 in its group.

    rewards: [B] float. Returns [B], same dtype. Unlike the group mean, the baseline does not
    contain the completion's own reward, so it is an unbiased baseline.
    """
    grouped = _grouped(rewards, group_size)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others_mean).flatten()


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": group_advantages,
    "rloo": rloo_advantages,
}


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """[B] -> [B / G, G], after checking the layout the estimators rely on."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    # A group of one has no others to compare with: its advantage would be 0 or 0 / 0.
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.reshape(-1, group_size)
