"""Supervised fine-tuning: next-token cross-entropy on the tokens that carry a label. Pure tensors.

Shapes: B rows, T positions, V vocabulary. ``labels[b, t]`` is the token that position t must
predict (already shifted by one), or IGNORE where nothing is learned (prompt, padding, the seam
between packed samples).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE = -100
"""The label of a position that carries no loss (torch's cross_entropy ignore_index)."""


def sft_loss(
    logits: Tensor, labels: Tensor, *, num_tokens: float | None = None
) -> tuple[Tensor, dict[str, float]]:
    """Summed cross-entropy of the labelled positions, divided by ``num_tokens``.

    logits: [B, T, V], any float dtype (computed in float32). labels: [B, T] int64 with IGNORE
    where there is no target. num_tokens: the labelled tokens of the whole batch these rows belong
    to, so that the results of its micro batches add up to the batch's token mean; None divides
    by this call's own count (a token mean of these rows). A call with no labelled token returns
    0 with a gradient of 0.

    Stats: loss (this call's value) and tokens (labelled tokens in these rows).
    """
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    count = int((labels != IGNORE).sum())
    divisor = float(num_tokens) if num_tokens is not None else float(max(1, count))
    if divisor <= 0:
        raise ValueError(f"num_tokens must be > 0, got {num_tokens}")
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
    loss = total / divisor
    return loss, {"loss": float(loss.detach()), "tokens": float(count)}


def sft_loss_from_logprobs(
    logprobs: Tensor, mask: Tensor, *, num_tokens: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """sft_loss from the log-probs of the labels (as a chunked head gives them, without logits).

    logprobs: [B, T] float32 log-prob of each position's label (any value where mask is 0);
    mask: [B, T] bool, True where the position has a label. Returns the summed negative log-prob
    of the labelled positions divided by num_tokens (> 0), and its value as a detached 0-dim
    tensor under "loss" (read it with the step's other metrics).
    """
    if logprobs.shape != mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and mask {tuple(mask.shape)} differ")
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be > 0, got {num_tokens}")
    loss = -torch.where(mask, logprobs.float(), 0.0).sum() / num_tokens
    return loss, {"loss": loss.detach()}
