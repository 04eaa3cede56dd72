"""Packed weights: a linear layer's weight reordered once for the CPU's fastest GEMM, and when
packing pays (should_pack). The planner mirrors the rule (rollout.planner.memory)."""

from __future__ import annotations

import functools

import torch

PACK_MIN_NEW_TOKENS = 16
"""Shortest generation worth packing the weights for: packing costs about as much time as ten
decode steps of SmolLM2 at batch 8 save with it (it mostly pays for fresh memory pages)."""

PACK_MAX_BYTES = 2 * 1024**3
"""Largest model (its 2-D weights, in bytes) to pack: the packed copy lives beside the weights
while a batch is sampled, memory that the plan's estimate does not count."""

ONEDNN_ROWS_HINT = 32
"""The row count oneDNN packs for: its packed copy then ran 1, 8 and 32 rows about as fast as
copies packed for exactly those counts (SmolLM2's layers; one packed for 1 row was 30% slower
at 32)."""


def packed_width(width: int) -> int | None:
    """The batch width a packed decoder is made for: None when one serves every width (oneDNN's
    packed copy, or none)."""
    return width if packing_kernel() == "mkl" else None


@functools.cache
def packing_kernel() -> str | None:
    """The packed GEMM this torch offers: "onednn" (mkldnn), else "mkl", else None.

    oneDNN's packed weight serves any number of rows; MKL's serves one. Measured on SmolLM2's
    layers (2 threads, AMD EPYC with AVX-512), oneDNN's fp32 product was 2.8x MKL's packed one at
    8 rows and 2.1x at 32, MKL's own packing being no faster than its plain sgemm there."""
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "onednn"
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        return "mkl"
    return None


class PackedLinear:
    """x @ weight.T + bias through a packed copy of `weight`, made once for many calls.

    kernel "onednn": oneDNN's packed weight (reordered for its GEMM; any number of rows works).
    "mkl": MKL's packed GEMM for exactly `rows` rows; other row counts take the plain path.
    None: the plain path, no copy.

    The packed copy is a snapshot of the weights: a DecodeBatch drops it when load_weights is
    called, and generate() packs anew at each call (the learner changes the weights in between).
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str | None, rows: int
    ) -> None:
        self.weight, self.bias, self.kernel, self.rows = weight, bias, kernel, rows
        self.packed: torch.Tensor | None = None
        if kernel == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_ROWS_HINT)
            self.weight = None  # only the packed copy is used (it may be a stacked weight)
        elif kernel == "mkl":
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.packed is None or x.shape[0] != self.rows:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, self.rows)


def should_pack(model: torch.nn.Module, max_new_tokens: int) -> bool:
    """Whether LlamaDecoder should pack the weights (packing_kernel): float32 on the CPU with
    torch built with oneDNN or MKL, a long enough generation to pay back the packing, and a
    packed copy (as large as the weights, for the life of the batch) of at most PACK_MAX_BYTES."""
    weights = [p for p in model.parameters() if p.dim() == 2]
    return (
        max_new_tokens >= PACK_MIN_NEW_TOKENS
        and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in weights)
        and sum(p.numel() * p.element_size() for p in weights) <= PACK_MAX_BYTES
        and packing_kernel() is not None
    )
