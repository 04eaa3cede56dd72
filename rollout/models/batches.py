"""Prompt + completion rows as one causal-LM batch: LEFT-padded, so every completion ends at the
last position (as rollout.runtime.online.batches.PaddedBatch). The logits of the last K + 1
positions cover every completion token, and the last position is every row's final token, where a
reward model reads its score. The offline objectives and the reward-model reward both use it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class CompletionBatch:
    """Shapes: input_ids, attention_mask, position_ids [B, L]; targets and mask [B, K], where
    position k holds token L - K + k, predicted by the logits at L - K - 1 + k."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    tokens: int
    """Real (not padding) tokens in the batch."""
    rows: torch.Tensor
    """[N] int64 indices of the completion tokens in the flattened [B * K] layout, on the CPU
    (computed where the mask was made: reading them never waits for the device)."""

    @property
    def logits_to_keep(self) -> int:
        return self.targets.shape[1] + 1

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def pad_completions(
    prompts: Sequence[list[int]],
    completions: Sequence[list[int]],
    pad_id: int,
    device: torch.device | str,
) -> CompletionBatch:
    rows = [p + c for p, c in zip(prompts, completions, strict=True)]
    length = max(len(r) for r in rows)
    longest = max(1, max(len(c) for c in completions))
    size = len(rows)
    input_ids = torch.full((size, length), pad_id, dtype=torch.long, device="cpu")
    attention = torch.zeros((size, length), dtype=torch.long, device="cpu")
    mask = torch.zeros((size, longest), dtype=torch.bool, device="cpu")
    for i, (row, completion) in enumerate(zip(rows, completions, strict=True)):
        input_ids[i, length - len(row) :] = torch.tensor(row, device="cpu")
        attention[i, length - len(row) :] = 1
        if completion:
            mask[i, longest - len(completion) :] = True
    # Positions count real tokens only, so a left-padded row sees the positions it would alone.
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return CompletionBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        position_ids=positions.to(device),
        targets=input_ids[:, length - longest :].to(device),
        mask=mask.to(device),
        tokens=sum(len(r) for r in rows),
        rows=mask.flatten().nonzero().squeeze(1),
    )
