"""A KV cache preallocated for a whole batch, written in place where DynamicCache concatenates."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def preallocated_cache(config: Any, capacity: int) -> DynamicCache:
    """A DynamicCache for the model's config whose full-attention layers hold up to `capacity`
    positions in buffers allocated once (sliding-window and other layer kinds are left as is)."""
    cache = DynamicCache(config=config)
    cache.layers = [
        PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer
        for layer in cache.layers
    ]
    return cache


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer that writes each step's keys and values into buffers sized for a whole
    batch, where DynamicLayer concatenates: that copies the layer's whole cache at every step.
    keys and values are views of the filled part, so attention sees exactly what it saw before."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = key_states.new_empty(
            *key_states.shape[:2], self.capacity, key_states.shape[3]
        )
        self._value_buffer = value_states.new_empty(
            *value_states.shape[:2], self.capacity, value_states.shape[3]
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache full: {end} positions, room for {self.capacity}")
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self.length = end
        self.keys = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` (repeats allowed): new buffers, with only the filled part copied."""
        if not self.is_initialized:
            return
        keys, values = self.keys[indices], self.values[indices]
        self._key_buffer = keys.new_empty(*keys.shape[:2], self.capacity, keys.shape[3])
        self._value_buffer = values.new_empty(*values.shape[:2], self.capacity, values.shape[3])
        self._key_buffer[:, :, : self.length] = keys
        self._value_buffer[:, :, : self.length] = values
        self.keys = self._key_buffer[:, :, : self.length]
        self.values = self._value_buffer[:, :, : self.length]

    def place_prefix(
        self, keys: torch.Tensor, values: torch.Tensor, firsts: Sequence[int], length: int
    ) -> None:
        """Into a fresh layer: a shared prefix's keys and values [1, kv_heads, L, head_dim] at
        columns firsts[i] .. firsts[i] + L - 1 of each row i; the filled length becomes `length`,
        where the next update writes. The rest is zeroed: it is masked, but attention multiplies
        its values by a weight of 0, and a NaN in uninitialized memory would survive that."""
        rows = len(firsts)
        self.lazy_initialization(keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1))
        self._key_buffer.zero_()
        self._value_buffer.zero_()
        span = keys.shape[-2]
        for row, first in enumerate(firsts):
            self._key_buffer[row, :, first : first + span] = keys[0]
            self._value_buffer[row, :, first : first + span] = values[0]
        self.length = length
        self.keys = self._key_buffer[:, :, :length]
        self.values = self._value_buffer[:, :, :length]

    def write(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, end: int) -> None:
        """Put keys and values [k, kv_heads, S, head_dim] (a prefill) into rows `rows` at
        columns end - S .. end - 1; the filled length stays as it is."""
        start = end - keys.shape[-2]
        self._key_buffer[rows, :, start:end] = keys
        self._value_buffer[rows, :, start:end] = values

    def relayout(self, rows: torch.Tensor | None, first: int, shift: int, capacity: int) -> None:
        """New buffers of `capacity` columns holding rows `rows` (all when None) of the filled
        columns first .. length-1, moved by `shift` columns.

        The columns before them are zeroed: they are masked, but attention still multiplies
        their values by a weight of 0, and a NaN in uninitialized memory would survive that.
        """
        end = self.length
        self._key_buffer = _moved(self._key_buffer, rows, first, end, shift, capacity)
        self._value_buffer = _moved(self._value_buffer, rows, first, end, shift, capacity)
        self.capacity, self.length = capacity, end + shift
        self.keys = self._key_buffer[:, :, : self.length]
        self.values = self._value_buffer[:, :, : self.length]


def _moved(
    buffer: torch.Tensor, rows: torch.Tensor | None, first: int, end: int, shift: int, capacity: int
) -> torch.Tensor:
    """buffer [B, H, C, D]'s rows `rows` (all when None), columns first .. end-1, at columns
    first + shift .. in a new buffer of `capacity` columns, zero before them."""
    part = buffer[:, :, first:end] if rows is None else buffer[rows, :, first:end]
    moved = part.new_empty(*part.shape[:2], capacity, part.shape[3])
    moved[:, :, : first + shift] = 0
    moved[:, :, first + shift : end + shift] = part
    return moved
