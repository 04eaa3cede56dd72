"""Summed log-probs of continuation tokens under a causal language model: what log-likelihood
multiple choice scores each choice by."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


@torch.no_grad()
def continuation_logprobs(
    model: Any, prompt_ids: Sequence[int], continuations: Sequence[Sequence[int]], pad_id: int
) -> list[float]:
    """For each continuation, sum over its tokens of log p(token | prompt, earlier tokens).

    One forward pass over the batch [prompt + continuation_i] (right-padded with `pad_id`, masked
    out): the logits at position t predict token t+1, so a continuation's tokens, starting at
    len(prompt), are read from the positions one before them. `model` is a Hugging Face causal
    LM; returns one float per continuation (an empty continuation scores 0.0).
    """
    if not prompt_ids:
        raise ValueError("continuation_logprobs: the prompt has no tokens")
    sequences = [list(prompt_ids) + list(tokens) for tokens in continuations]
    width = max(len(sequence) for sequence in sequences)
    device = next(model.parameters()).device
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence, device=device)
        mask[row, : len(sequence)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt_ids)
    sums = []
    for row, tokens in enumerate(continuations):
        if not tokens:
            sums.append(0.0)
            continue
        positions = torch.arange(start - 1, start - 1 + len(tokens), device=device)
        targets = torch.tensor(list(tokens), device=device)
        sums.append(float(logprobs[row, positions, targets].sum()))
    return sums
