"""Prompts laid out for a batch: left padding, the distinct prompts, their shared prefix."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def left_pad(
    prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts padded on the left to one width: (input_ids [B, P], attention_mask [B, P]) on
    `device`, built on the host and moved once (not one small copy per row)."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device="cpu")
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long, device="cpu")
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long, device="cpu")
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def distinct_prompts(prompts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts in order of first appearance, and which of them each prompt is."""
    first: dict[tuple[int, ...], int] = {}
    which = [first.setdefault(tuple(prompt), len(first)) for prompt in prompts]
    return [list(prompt) for prompt in first], which


def shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens all of `prompts` share (two or more), leaving every prompt at
    least one token of its own to run; 0 for a single prompt."""
    if len(prompts) < 2:
        return 0
    shortest = min(len(prompt) for prompt in prompts)
    length = 0
    while length < shortest - 1 and all(p[length] == prompts[0][length] for p in prompts):
        length += 1
    return length
