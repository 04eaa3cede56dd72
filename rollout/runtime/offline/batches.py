"""Padding (and packing) offline samples into tensors for one forward pass.

Two layouts:

- ``pad_completions`` (rollout.models.batches, shared with the reward-model reward): prompt +
  completion rows, LEFT-padded, so every completion ends at the last position.
- ``pad_sequences`` and ``pack_sequences`` (SFT): RIGHT-padded rows with shifted labels, or
  several samples per row with position ids restarting at each sample and no attention mask, from
  which transformers builds a block-diagonal causal mask: attention never crosses samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollout.algorithms.sft import IGNORE
from rollout.models.samples import Demonstration


@dataclass
class TokenBatch:
    """Rows for next-token loss. input_ids, labels [B, L]; labels[b, t] is the token position t
    predicts, or IGNORE. attention_mask [B, L] when rows are padded, None when every position is
    real (or rows are packed: then position_ids [B, L] restart at each sample)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    row_tokens: list[int]
    """Real (not padding) tokens in each row."""
    target_rows: torch.Tensor
    """[N] int64 indices of the labelled positions in the flattened [B * L] layout, on the CPU
    (made with the labels: reading them never waits for the device)."""

    @property
    def tokens(self) -> int:
        return sum(self.row_tokens)

    @property
    def num_targets(self) -> int:
        return len(self.target_rows)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, start: int, stop: int) -> TokenBatch:
        """Rows start..stop-1 (a micro batch)."""
        part = slice(start, stop)
        width = self.input_ids.shape[1]
        inside = (self.target_rows >= start * width) & (self.target_rows < stop * width)
        return TokenBatch(
            input_ids=self.input_ids[part],
            labels=self.labels[part],
            attention_mask=None if self.attention_mask is None else self.attention_mask[part],
            position_ids=None if self.position_ids is None else self.position_ids[part],
            row_tokens=self.row_tokens[part],
            target_rows=self.target_rows[inside] - start * width,
        )


def _labels(sample: Demonstration) -> list[int]:
    """Position t predicts token t + 1 where that token is a target; the last predicts nothing."""
    ids, targets = sample.ids, sample.targets
    return [ids[t + 1] if targets[t + 1] else IGNORE for t in range(len(ids) - 1)] + [IGNORE]


def pad_sequences(
    samples: Sequence[Demonstration], pad_id: int, device: torch.device | str
) -> TokenBatch:
    """One sample per row, right-padded."""
    length = max(s.length for s in samples)
    input_ids = torch.full((len(samples), length), pad_id, dtype=torch.long, device="cpu")
    labels = torch.full((len(samples), length), IGNORE, dtype=torch.long, device="cpu")
    attention = torch.zeros((len(samples), length), dtype=torch.long, device="cpu")
    for i, sample in enumerate(samples):
        input_ids[i, : sample.length] = torch.tensor(sample.ids, device="cpu")
        labels[i, : sample.length] = torch.tensor(_labels(sample), device="cpu")
        attention[i, : sample.length] = 1
    padded = bool((attention == 0).any())
    return TokenBatch(
        input_ids=input_ids.to(device),
        labels=labels.to(device),
        # Without padding the model takes its fast causal path.
        attention_mask=attention.to(device) if padded else None,
        position_ids=None,
        row_tokens=[s.length for s in samples],
        target_rows=_target_rows(labels),
    )


def pack_sequences(
    samples: Sequence[Demonstration], max_length: int, pad_id: int, device: torch.device | str
) -> TokenBatch:
    """Samples packed first-fit, in order, into rows of at most ``max_length`` tokens.

    Each sample keeps its own positions 0..n-1 and the seam between samples carries no label, so
    with attention confined to each sample (transformers reads the restarts in position_ids when
    no attention mask is given) every sample's loss is what it would be alone. A row's padding
    forms a sample of its own, with no labels.
    """
    rows: list[list[Demonstration]] = []
    room: list[int] = []
    for sample in samples:
        if sample.length > max_length:
            raise ValueError(f"a sample of {sample.length} tokens exceeds max_length {max_length}")
        for r, free in enumerate(room):
            if sample.length <= free:
                rows[r].append(sample)
                room[r] -= sample.length
                break
        else:
            rows.append([sample])
            room.append(max_length - sample.length)
    length = max(max_length - free for free in room)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long, device="cpu")
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long, device="cpu")
    positions = torch.zeros((len(rows), length), dtype=torch.long, device="cpu")
    for r, row in enumerate(rows):
        start = 0
        for sample in row:
            end = start + sample.length
            input_ids[r, start:end] = torch.tensor(sample.ids, device="cpu")
            labels[r, start:end] = torch.tensor(_labels(sample), device="cpu")
            positions[r, start:end] = torch.arange(sample.length, device="cpu")
            start = end
        positions[r, start:] = torch.arange(length - start, device="cpu")
    return TokenBatch(
        input_ids=input_ids.to(device),
        labels=labels.to(device),
        attention_mask=None,
        position_ids=positions.to(device),
        row_tokens=[max_length - free for free in room],
        target_rows=_target_rows(labels),
    )


def _target_rows(labels: torch.Tensor) -> torch.Tensor:
    """[N] flat indices of the labelled positions of CPU `labels` [B, L]."""
    return (labels != IGNORE).flatten().nonzero().squeeze(1)
