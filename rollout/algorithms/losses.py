"""Policy-gradient losses: pure tensor functions.

Shapes: B sequences, T completion positions (right-padded), V vocabulary. ``mask`` [B, T] is 1 on
the completion tokens that count and 0 on padding; per-token values where it is 0 are ignored.

The pieces compose as ``grpo_loss`` does: per-token policy loss (``clipped_policy_loss``), plus a
per-token KL penalty (``kl_penalty``), reduced to one number (``aggregate``). Diagnostics come back
per token, so they are reduced under the same mask as the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from torch import Tensor

_Entry = TypeVar("_Entry")

# ---------------------------------------------------------------------------------------------
# log-probabilities and entropy from logits


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) at ``tokens``.

    logits: [B, T, V], any float dtype. tokens: [B, T] int64. Returns [B, T] float32.

    Pass the sampling temperature, so these are log-probs of the distribution the tokens were
    drawn from. Computed one sequence at a time as ``logit - logsumexp(logits)``: no [B, T, V]
    log_softmax is built, and the only [B, T, V] float32 copy is the one autograd keeps for
    backward (none at all for float32 logits at temperature 1).
    """
    rows = [
        scaled.gather(-1, row_tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
        for scaled, row_tokens in zip(_scaled_rows(logits, temperature), tokens, strict=True)
    ]
    return torch.stack(rows)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) at each position, in nats.

    logits: [B, T, V], any float dtype. Returns [B, T] float32. One sequence at a time, as
    ``token_logprobs``, using H = logsumexp(z) - sum(softmax(z) * z).
    """
    rows = [
        torch.logsumexp(scaled, dim=-1) - (torch.softmax(scaled, dim=-1) * scaled).sum(dim=-1)
        for scaled in _scaled_rows(logits, temperature)
    ]
    return torch.stack(rows)


def _scaled_rows(logits: Tensor, temperature: float) -> Iterator[Tensor]:
    """[B, T, V] -> B float32 [T, V] tensors divided by the temperature, made one at a time."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    rows = (row.float() for row in logits)
    return rows if temperature == 1.0 else (row / temperature for row in rows)


# ---------------------------------------------------------------------------------------------
# KL to the reference model


def _k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


def _k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return 0.5 * (logprobs - ref_logprobs).square()


def _k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    # exp(d) - d - 1, written with expm1: near d = 0 the literal form loses every digit to rounding
    # and can come out below 0; expm1(d) >= d holds after rounding too.
    d = ref_logprobs - logprobs
    return torch.expm1(d) - d


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(p || ref) from tokens sampled from p.

    logprobs, ref_logprobs: [B, T]. Returns [B, T]. With r = ref / p (Schulman, "Approximating KL
    divergence"): k1 = -log r (unbiased, negative on some tokens), k2 = (log r)^2 / 2 (biased,
    low variance, >= 0), k3 = r - 1 - log r (unbiased and >= 0).
    """
    return _choose(KL_ESTIMATORS, estimator, "KL estimator")(logprobs, ref_logprobs)


# ---------------------------------------------------------------------------------------------
# the clipped surrogate objective


@dataclass(frozen=True)
class PolicyStats:
    """Per-token diagnostics of the clipped objective, [B, T], detached; reduce with masked_mean.

    clipped_low / clipped_high are 1.0 where the clip took that token's gradient away: the ratio
    fell below 1 - clip_low with a negative advantage, or rose above 1 + clip_high with a
    positive one. approx_kl is the k3 estimate of KL(old || new), how far this update has moved.
    """

    ratio: Tensor
    clipped_low: Tensor
    clipped_high: Tensor
    approx_kl: Tensor


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, PolicyStats]:
    """PPO's clipped surrogate, as a loss: -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A).

    logprobs: [B, T] under the policy being trained (with grad). old_logprobs: [B, T] under the
    policy that sampled the tokens. advantages: [B] (one per sequence, GRPO/RLOO) or [B, T] (per
    token, PPO). r = exp(logprobs - old_logprobs). Returns the per-token loss [B, T] and its stats.
    """
    if logprobs.shape != old_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and old_logprobs {tuple(old_logprobs.shape)} differ"
        )
    # [B] -> [B, 1]: broadcast over positions, never over sequences (which B == T would allow).
    advantages = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)

    ratio = ratio.detach()
    stats = PolicyStats(
        ratio=ratio,
        clipped_low=((ratio < 1 - clip_low) & (advantages < 0)).to(ratio.dtype),
        clipped_high=((ratio > 1 + clip_high) & (advantages > 0)).to(ratio.dtype),
        approx_kl=kl_penalty(old_logprobs, logprobs.detach(), "k3"),
    )
    return loss, stats


def stale_correction(
    logprobs: Tensor, sampling_logprobs: Tensor, mask: Tensor, mode: str, bound: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token advantage weights [B, T] for a batch sampled by an older policy, and their
    metrics (0-dim, detached, as grpo_loss's).

    logprobs: [B, T] under the policy being trained (detached here: the weights carry no
    gradient); sampling_logprobs: [B, T] the engine's, of the policy that sampled the tokens.
    With r = exp(logprobs - sampling_logprobs) per token:

    - "tis": weight min(r, bound) (truncated importance sampling); metrics stale_weight_mean and
      stale_truncated_fraction (tokens with r > bound);
    - "drop": weight 1 for a sequence whose every token has 1 / bound <= r <= bound, else 0;
      metrics stale_weight_mean and stale_dropped_fraction (of the rows given).

    Positions where ``mask`` is 0 weigh 1 and count in no metric.
    """
    valid = mask.bool()
    log_ratio = torch.where(valid, logprobs.detach().float() - sampling_logprobs.float(), 0.0)
    ratio = torch.exp(log_ratio)
    stats: dict[str, Tensor] = {}
    if mode == "tis":
        weights = ratio.clamp(max=bound)
        stats["stale_truncated_fraction"] = masked_mean((ratio > bound).float(), mask)
    elif mode == "drop":
        outside = ((ratio > bound) | (ratio < 1 / bound)) & valid
        keep = (~outside.any(dim=-1)).float()
        weights = torch.where(valid, keep.unsqueeze(-1), 1.0)
        stats["stale_dropped_fraction"] = 1.0 - keep.mean()
    else:
        raise ValueError(f"unknown stale_samples mode {mode!r}; choose one of: tis, drop")
    stats["stale_weight_mean"] = masked_mean(weights, mask)
    return weights, {name: value.detach() for name, value in stats.items()}


# ---------------------------------------------------------------------------------------------
# per-token values -> one number


class Aggregation(Protocol):
    """The signature every loss aggregation shares; each reads only the counts it needs."""

    def __call__(
        self,
        per_token: Tensor,
        mask: Tensor,
        *,
        total_tokens: int | None = None,
        max_new_tokens: int | None = None,
        num_sequences: int | None = None,
    ) -> Tensor: ...


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` where ``mask`` is 1: [B, T], [B, T] -> []. 0 (not NaN) if none is."""
    return _masked(values, mask).sum() / mask.sum().clamp(min=1)


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    # where, not values * mask: padding may hold inf or NaN (say, log-probs of pad tokens), and
    # NaN * 0 is NaN.
    return torch.where(mask.bool(), values, 0.0)


def token_mean(
    per_token: Tensor,
    mask: Tensor,
    *,
    total_tokens: int | None = None,
    max_new_tokens: int | None = None,
    num_sequences: int | None = None,
) -> Tensor:
    """sum(loss * mask) / sum(mask) over the rows given: every token weighs the same."""
    return masked_mean(per_token, mask)


def sequence_mean(
    per_token: Tensor,
    mask: Tensor,
    *,
    total_tokens: int | None = None,
    max_new_tokens: int | None = None,
    num_sequences: int | None = None,
) -> Tensor:
    """Each row's masked mean, then the mean over rows (GRPO as published).

    Every sequence weighs the same, so a token of a short completion weighs more than a token of
    a long one. A row with no tokens contributes 0.
    """
    per_sequence = _masked(per_token, mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    return per_sequence.mean()


def batch_token_mean(
    per_token: Tensor,
    mask: Tensor,
    *,
    total_tokens: int | None = None,
    max_new_tokens: int | None = None,
    num_sequences: int | None = None,
) -> Tensor:
    """sum(loss * mask) / total_tokens (DAPO).

    total_tokens counts the completion tokens of the whole batch these rows are part of, so the
    results for its micro-batches add up to the token mean over the whole batch.
    """
    if total_tokens is None or total_tokens < 1:
        raise ValueError(f"batch_token_mean needs total_tokens >= 1, got {total_tokens}")
    return _masked(per_token, mask).sum() / total_tokens


def constant(
    per_token: Tensor,
    mask: Tensor,
    *,
    total_tokens: int | None = None,
    max_new_tokens: int | None = None,
    num_sequences: int | None = None,
) -> Tensor:
    """sum(loss * mask) / (num_sequences * max_new_tokens) (Dr. GRPO).

    The divisor does not depend on the completions' lengths, so no token's gradient is scaled by
    how long its completion or its batch happened to be. num_sequences: the rows given when None;
    pass the whole batch's count to make micro-batch results add up to the batch's.
    """
    if max_new_tokens is None or max_new_tokens < 1:
        raise ValueError(f"constant aggregation needs max_new_tokens >= 1, got {max_new_tokens}")
    sequences = per_token.shape[0] if num_sequences is None else num_sequences
    return _masked(per_token, mask).sum() / (sequences * max_new_tokens)


LOSS_AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": token_mean,
    "sequence_mean": sequence_mean,
    "batch_token_mean": batch_token_mean,
    "constant": constant,
}


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    *,
    total_tokens: int | None = None,
    max_new_tokens: int | None = None,
    num_sequences: int | None = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] under ``mask`` [B, T] to a scalar, by ``mode``.

    token_mean and sequence_mean are means over the rows given: a caller that accumulates
    gradients over k micro-batches divides those by k. batch_token_mean and constant divide by
    counts of the whole batch, which the caller passes, so micro-batch results add up as they are.
    """
    if per_token.shape != mask.shape:
        raise ValueError(f"per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} differ")
    return _choose(LOSS_AGGREGATIONS, mode, "loss aggregation")(
        per_token,
        mask,
        total_tokens=total_tokens,
        max_new_tokens=max_new_tokens,
        num_sequences=num_sequences,
    )


# ---------------------------------------------------------------------------------------------
# the whole GRPO / RLOO objective


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    aggregation: str = "token_mean",
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Tensor | None = None,
    total_tokens: int | None = None,
    max_new_tokens: int | None = None,
    num_sequences: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy loss plus kl_coef * KL to the reference, per token, then aggregated.

    logprobs, old_logprobs, mask: [B, T]; advantages: [B]; ref_logprobs (needed when kl_coef > 0)
    and entropy (reported only): [B, T]. The counts go to ``aggregate``.

    Returns the loss (a scalar with grad) and metrics: token means over these rows of
    policy_loss, ratio_mean, clip_fraction (with its _low and _high parts), approx_kl (old -> new),
    and kl (when ref_logprobs is given) and entropy (when given). The metrics are detached 0-dim
    float32 tensors on the loss's device: a caller sums them over micro batches where they are
    and reads them once (read_metrics), so the step never waits for the device to report them.
    """
    if kl_coef and ref_logprobs is None:
        raise ValueError(f"kl_coef is {kl_coef} but no ref_logprobs were given")
    per_token, stats = clipped_policy_loss(logprobs, old_logprobs, advantages, clip_low, clip_high)
    terms = {
        "policy_loss": per_token.detach(),
        "ratio_mean": stats.ratio,
        "clip_fraction": stats.clipped_low + stats.clipped_high,
        "clip_fraction_low": stats.clipped_low,
        "clip_fraction_high": stats.clipped_high,
        "approx_kl": stats.approx_kl,
    }
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, kl_estimator)
        per_token = per_token + kl_coef * kl
        terms["kl"] = kl.detach()
    if entropy is not None:
        terms["entropy"] = entropy.detach()
    loss = aggregate(
        per_token,
        mask,
        aggregation,
        total_tokens=total_tokens,
        max_new_tokens=max_new_tokens,
        num_sequences=num_sequences,
    )
    return loss, _token_means(terms, mask)


def _token_means(terms: Mapping[str, Tensor], mask: Tensor) -> dict[str, Tensor]:
    means = torch.stack([masked_mean(term.float(), mask) for term in terms.values()]).detach()
    return dict(zip(terms, means.unbind(), strict=True))


def read_metrics(metrics: Mapping[str, Tensor | float]) -> dict[str, float]:
    """Tensor metrics (0-dim, on any one device) and plain numbers -> numbers, with one
    device-to-host copy for all the tensors: the one wait for the device a caller pays."""
    tensors = {name: value for name, value in metrics.items() if isinstance(value, Tensor)}
    read = dict(metrics)
    if tensors:
        values = torch.stack([t.detach().float() for t in tensors.values()]).tolist()
        read.update(zip(tensors, values, strict=True))
    return {name: float(value) for name, value in read.items()}


def _choose(registry: Mapping[str, _Entry], name: str, what: str) -> _Entry:
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; choose one of: {', '.join(registry)}")
    return registry[name]


# ---------------------------------------------------------------------------------------------
# the critic (PPO)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's value loss, per token then token-mean: 0.5 * (V - R)^2, or with clip,
    0.5 * max((V - R)^2, (V_clipped - R)^2), V_clipped = old_V + clamp(V - old_V, -clip, clip).

    values: [B, T] from the critic being trained (with grad); old_values: [B, T] the critic's
    values when the batch was scored; returns: [B, T] targets. Returns the scalar loss and
    metrics (0-dim tensors, as grpo_loss's): value_loss, value_mean, returns_mean,
    value_clip_fraction (the share of tokens whose clipped error was the larger one).
    """
    error = (values - returns).square()
    if clip is None:
        per_token = 0.5 * error
        clipped_share = torch.zeros_like(error)
    else:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        clipped_error = (clipped - returns).square()
        per_token = 0.5 * torch.maximum(error, clipped_error)
        clipped_share = (clipped_error > error).float()
    loss = masked_mean(per_token, mask)
    stats = _token_means(
        {
            "value_loss": per_token.detach(),
            "value_mean": values.detach(),
            "returns_mean": returns,
            "value_clip_fraction": clipped_share,
        },
        mask,
    )
    return loss, stats
