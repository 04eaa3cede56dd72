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

import torch
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


# ---------------------------------------------------------------------------------------------
# Per-token advantages (PPO, REINFORCE++)
#
# Shapes: [B, T] with each row's completion in its LAST columns (the learner's layout, see
# rollout.runtime.online.batches.PaddedBatch), and mask [B, T] marking the policy's tokens: the
# actions. Values at masked positions are ignored and come back as 0. In a multi-turn episode the
# environment's messages sit between the policy's answers with mask 0: they are not actions, so
# the recursions below run over the policy's tokens alone, as if the environment's were not
# there (gamma and lambda apply between consecutive policy tokens, across a turn boundary as
# within an answer).


def kl_shaped_rewards(
    rewards: Tensor,
    kl: Tensor | None,
    mask: Tensor,
    *,
    kl_coef: float = 0.0,
    placed: Tensor | None = None,
) -> Tensor:
    """Per-token rewards: -kl_coef * kl at every policy token, plus the sequence's reward at its
    last policy token.

    rewards: [B] sequence rewards. kl: [B, T] per-token KL estimate to the reference (None or
    kl_coef 0: no penalty). placed: [B, T] rewards already on their tokens (a multi-turn
    episode's per-turn rewards, each on its answer's last token), used instead of `rewards`.
    Returns [B, T], 0 where mask is 0. Classic RLHF-PPO and REINFORCE++ put the KL to the
    reference into the reward this way rather than into the loss.
    """
    shaped = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if kl is not None and kl_coef:
        shaped = shaped - kl_coef * kl.float()
    if placed is not None:
        shaped = shaped + placed.float()
    else:
        rows = torch.arange(mask.shape[0], device=mask.device)
        shaped[rows, last_policy_token(mask)] += rewards.float()
    return torch.where(mask.bool(), shaped, 0.0)


def last_policy_token(mask: Tensor) -> Tensor:
    """[B, T] mask -> [B] the column of each row's last policy token (T - 1 for a row with none:
    whatever lands there is masked out)."""
    columns = mask.shape[1]
    return columns - 1 - mask.bool().flip(1).int().argmax(dim=1)


def discounted_returns(token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """G_t = sum over policy tokens s >= t of gamma^(steps from t to s) * r_s, within each row:
    [B, T] -> [B, T]."""
    order, _ = _policy_steps(mask)
    rewards = token_rewards.float().gather(1, order)
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=torch.float32, device=mask.device)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return _scattered(returns, order, mask)


def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016): (advantages, returns), [B, T].

    values: [B, T], V(s_t), the critic's value before token t. Over each row's policy tokens in
    order, t + 1 being the next policy token: the episode ends after the last (the value after
    it is 0), delta_t = r_t + gamma * V_{t+1} - V_t, and A_t = delta_t + gamma * lam * A_{t+1};
    the critic's targets are returns = A + V.
    """
    order, policy = _policy_steps(mask)
    values = torch.where(policy, values.float().gather(1, order), 0.0)
    rewards = token_rewards.float().gather(1, order)
    advantages = torch.zeros_like(values)
    running = torch.zeros(values.shape[0], dtype=torch.float32, device=values.device)
    next_value = torch.zeros_like(running)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
        next_value = values[:, t]
    return _scattered(advantages, order, mask), _scattered(advantages + values, order, mask)


def _policy_steps(mask: Tensor) -> tuple[Tensor, Tensor]:
    """A permutation of each row's columns that keeps its policy tokens in order and moves them
    to the row's last columns (the environment's tokens and the padding before them), and the
    mask in that order. A recursion over the permuted row steps from policy token to policy
    token; a single answer's row (its tokens already last) is left as it is."""
    order = torch.sort(mask.bool().to(torch.int8), dim=1, stable=True).indices
    return order, mask.bool().gather(1, order)


def _scattered(values: Tensor, order: Tensor, mask: Tensor) -> Tensor:
    """The inverse of gathering with `order`, 0 where mask is 0."""
    back = torch.zeros_like(values).scatter_(1, order, values)
    return torch.where(mask.bool(), back, 0.0)


def whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(values - mean) / std over the masked entries of the whole batch: [B, T] -> [B, T].

    shift_mean=False only scales (keeps the sign of every entry). The std is the unbiased one, as
    torch.std; with fewer than 2 entries the values are only centred.
    """
    selected = values[mask.bool()].float()
    mean = selected.mean() if selected.numel() else values.new_zeros(())
    std = selected.std() if selected.numel() > 1 else values.new_ones(())
    centred = values - mean
    scaled = (centred / (std + eps)) if shift_mean else (values / (std + eps))
    return torch.where(mask.bool(), scaled, 0.0)


def reinforce_pp_advantages(
    rewards: Tensor,
    kl: Tensor | None,
    mask: Tensor,
    *,
    kl_coef: float,
    gamma: float = 1.0,
    group_size: int = 1,
    baseline: Literal["none", "group"] = "none",
    placed: Tensor | None = None,
) -> Tensor:
    """REINFORCE++ (Hu 2025): KL-shaped token rewards, their discounted returns, whitened over
    the whole batch (the global normalization that replaces a critic). [B, T].

    baseline "group" (REINFORCE++-baseline) first subtracts the mean reward of the completion's
    group (completions of one prompt, contiguous groups of group_size) at its last policy token.
    placed: per-turn rewards on their tokens, as kl_shaped_rewards takes them; `rewards` are
    then the episodes' returns, which the baseline is the mean of.
    """
    if baseline == "group":
        grouped = _grouped(rewards, group_size)
        base = grouped.mean(dim=1, keepdim=True).expand_as(grouped).flatten()
        if placed is not None:
            placed = placed.float().clone()
            placed[torch.arange(len(base), device=mask.device), last_policy_token(mask)] -= base
        rewards = rewards - base
    elif baseline != "none":
        raise ValueError(f"baseline must be 'none' or 'group', got {baseline!r}")
    shaped = kl_shaped_rewards(rewards, kl, mask, kl_coef=kl_coef, placed=placed)
    return whiten(discounted_returns(shaped, mask, gamma=gamma), mask)


def turn_advantages(
    returns_to_go: Tensor,
    group_size: int,
    *,
    baseline: Literal["mean", "leave_one_out"] = "mean",
    scale: RewardScale = "group",
    eps: float = 1e-6,
) -> Tensor:
    """Per-turn advantages of multi-turn episodes: each answer's return from its turn on, against
    a baseline and scale taken from the episodes' whole returns.

    returns_to_go: [E, T] float, E episodes in groups of G (as rewards above), T the most turns;
    column 0 is each episode's return. Columns past an episode's last turn are ignored (any
    value). Returns [E, T]: ``(R[i, t] - b_i) / s``, where b_i is the group's mean return
    ("mean", GRPO) or the mean of the other G - 1 ("leave_one_out", RLOO, which never scales),
    and s the std as group_advantages takes it. With one turn this is exactly group_advantages
    (or rloo_advantages) of the returns.
    """
    if returns_to_go.dim() != 2:
        raise ValueError(f"returns_to_go must be 2-D [E, T], got {tuple(returns_to_go.shape)}")
    returns = returns_to_go[:, 0]
    grouped = _grouped(returns, group_size)
    if baseline == "mean":
        base = grouped.mean(dim=1, keepdim=True).expand_as(grouped)
    elif baseline == "leave_one_out":
        base = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
        scale = "none"
    else:
        raise ValueError(f"baseline must be 'mean' or 'leave_one_out', got {baseline!r}")
    centred = returns_to_go - base.flatten()[:, None]
    if scale == "none":
        return centred
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True).expand_as(grouped).flatten()[:, None]
    elif scale == "batch":
        std = returns.std()
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return centred / (std + eps)
