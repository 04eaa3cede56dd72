"""Token log-probs and entropies from final hidden states, through the vocabulary projection in
chunks of tokens: the [tokens, V] logits are never materialized, in the forward or the backward.

For a small model with a large vocabulary the logits are the largest activation of a training
step: SmolLM2-135M (V = 49,152) scoring 64 completions of 128 tokens holds 8,192 x 49,152 float32
logits, 1.6 GB, twice over (the logits and the copy autograd keeps), against 0.3 GB for the
whole transformer's activations. Here each chunk's logits live only while that chunk is reduced
to its log-prob and entropy; the backward recomputes them (one more [chunk, H] x [H, V] matmul
per chunk, as Liger-Kernel's fused linear cross-entropy does) and turns them into the gradients
of the hidden states, the projection weight and its bias.

Shapes: M positions, H hidden size, V vocabulary, N of the M positions selected (the completion
tokens; padding and prompt positions cost nothing). The projection runs in `compute_dtype` (the
model's dtype, or the autocast dtype), the softmax in float32, as transformers' lm_head followed
by ``.float()`` does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

DEFAULT_CHUNK_BYTES = 256 * 1024**2
"""The float32 logits of one chunk: 256 MiB, 1,365 tokens of a 49,152-token vocabulary. Measured
on the CPU (SmolLM2's head, 1,024 tokens, forward and backward, 2 threads): 2.25 s at 256 MiB,
2.40 s at 128 MiB, 2.71 s at 64 MiB, against 2.55 s for the full logits; above 256 MiB nothing
more is gained (benchmarks/README.md)."""


def chunk_tokens(vocab_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk such that one chunk's float32 logits take about `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * vocab_size))


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    tokens: Tensor,
    rows: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    compute_dtype: torch.dtype | None = None,
    entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log softmax((hidden @ weight.T + bias) / temperature) at `tokens`, and the entropy of that
    distribution, at the positions `rows` selects.

    hidden: [M, H] (any float dtype, with grad). weight: [V, H]; bias: [V] or None. tokens: [M]
    int64 (read only at `rows`). rows: [N] int64 indices into M, each at most once, on hidden's
    device. Returns logprobs [M] float32 (0 where not selected; differentiable with respect to
    hidden, weight and bias) and, with `entropy`, entropies [M] float32 in nats (0 where not
    selected; no gradient), else None.

    chunk_size: positions per chunk (default: chunk_tokens(V)). compute_dtype: the dtype of the
    projection's matmuls (default: weight's).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.dim() != 2 or tokens.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be [M, H] and tokens [M], got {tuple(hidden.shape)} and "
            f"{tuple(tokens.shape)}"
        )
    chunk = chunk_size if chunk_size is not None else chunk_tokens(weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk}")
    dtype = compute_dtype if compute_dtype is not None else weight.dtype
    logprobs, entropies = _ChunkedHead.apply(
        hidden, weight, bias, tokens, rows, float(temperature), chunk, dtype, entropy
    )
    return logprobs, (entropies if entropy else None)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        tokens: Tensor,
        rows: Tensor,
        temperature: float,
        chunk: int,
        dtype: torch.dtype,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        logprobs = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropies = torch.zeros(
            hidden.shape[0] if with_entropy else 0, dtype=torch.float32, device=hidden.device
        )
        # The logsumexp of every selected row, kept for the backward: it then needs one matmul
        # per chunk, not a second reduction too.
        lse = torch.empty(rows.shape[0], dtype=torch.float32, device=hidden.device)
        w, b = _cast(weight, dtype), _cast(bias, dtype)
        with _no_autocast(hidden):
            for start in range(0, rows.shape[0], chunk):
                index = rows[start : start + chunk]
                logits = _logits(hidden.index_select(0, index), w, b, temperature, dtype)
                chunk_lse = torch.logsumexp(logits, dim=-1)
                target = logits.gather(1, tokens.index_select(0, index)[:, None]).squeeze(1)
                logprobs.index_copy_(0, index, target - chunk_lse)
                lse[start : start + chunk] = chunk_lse
                if with_entropy:
                    # H = logsumexp(z) - sum(softmax(z) * z)
                    probs = logits.sub(chunk_lse[:, None]).exp_()
                    entropies.index_copy_(0, index, chunk_lse - torch.linalg.vecdot(probs, logits))
        ctx.save_for_backward(hidden, weight, bias, tokens, rows, lse)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.mark_non_differentiable(entropies)
        return logprobs, entropies

    @staticmethod
    def backward(ctx: Any, grad_logprobs: Tensor, _grad_entropies: Tensor) -> tuple:  # type: ignore[override]
        hidden, weight, bias, tokens, rows, lse = ctx.saved_tensors
        temperature, chunk, dtype = ctx.temperature, ctx.chunk, ctx.dtype
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        # Weight and bias gradients summed over chunks in float32 (rounded once at the end, as
        # one whole matmul would round them).
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if need_weight
            else None
        )
        grad_bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            if need_bias and bias is not None
            else None
        )
        w, b = _cast(weight, dtype), _cast(bias, dtype)
        with _no_autocast(hidden):
            for start in range(0, rows.shape[0], chunk):
                index = rows[start : start + chunk]
                h = hidden.index_select(0, index).to(dtype)
                logits = _logits(h, w, b, temperature, dtype)
                g = grad_logprobs.index_select(0, index).float()
                # d logprob / d z = onehot(token) - softmax(z); times g; z = logits / temperature.
                grad_z = logits.sub_(lse[start : start + chunk, None]).exp_().mul_(-g[:, None])
                grad_z.scatter_add_(1, tokens.index_select(0, index)[:, None], g[:, None])
                grad_z.div_(temperature)
                grad_z_low = grad_z.to(dtype)
                if grad_hidden is not None:
                    grad_hidden.index_copy_(0, index, (grad_z_low @ w).to(hidden.dtype))
                if grad_weight is not None:
                    grad_weight.add_(grad_z_low.t() @ h)
                if grad_bias is not None:
                    grad_bias.add_(grad_z.sum(0))
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def _logits(
    h: Tensor, w: Tensor, b: Tensor | None, temperature: float, dtype: torch.dtype
) -> Tensor:
    """[c, H] -> [c, V] float32 logits divided by the temperature (a fresh tensor: callers
    work on it in place)."""
    projected = h.to(dtype) @ w.t()
    if b is not None:
        projected = projected + b
    logits = projected.float()  # the matmul's fresh result, or a fresh float32 copy of it
    return logits.div_(temperature) if temperature != 1.0 else logits


def _cast(tensor: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if tensor is None else tensor.detach().to(dtype)


def _no_autocast(hidden: Tensor) -> Any:
    """Every dtype here is chosen explicitly: an enclosing autocast must not re-cast the matmuls
    (the backward runs outside it anyway)."""
    return torch.autocast(hidden.device.type, enabled=False)
