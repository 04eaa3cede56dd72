"""LlamaDecoder: a Llama-family forward written out in plain torch, over packed weights.

Llama-family models (llama, mistral, qwen2) prefill and decode through it: oneDNN's packed weights
serve any batch width, else MKL's, packed per batch width (rollout.engines.hf.packing); other
models run their own forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from rollout.engines.hf.adapters import (
    LowRank,
    adapted_output,
    base_linear,
    effective_weight,
    is_linear,
    low_ranks,
)
from rollout.engines.hf.kv_cache import PreallocatedLayer
from rollout.engines.hf.packing import PackedLinear

_LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2"})
"""model_types whose decoder layer is exactly what LlamaDecoder computes: pre-norm, q/k/v/o
projections (biases allowed) with rotary embeddings and grouped-query attention, gated MLP."""

_ATTENTION_CHILDREN = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")

_RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})
"""Norm modules that compute exactly torch's rms_norm: x * rsqrt(mean(x^2) + eps) * weight."""


class LlamaDecoder:
    """One decode step of a Llama-family model in plain torch, over the model's own weights and
    modules (embedding, rotary embedding, activation) and a batch's preallocated cache.

    Why: at batch 8 on CPU, transformers' per-module Python, mask building and cache bookkeeping
    cost about a fifth of a step; this is about a dozen tensor ops per layer. With a packing
    `kernel` the linear layers run on a packed copy of their weights (PackedLinear), and with
    oneDNN's the q, k and v projections are one GEMM, as are the gate and up projections: fewer,
    larger products. The prefill still runs the model itself.
    """

    @staticmethod
    def supports(model: Any, cache: DynamicCache) -> bool:
        """Whether `model` is a Llama-family causal LM whose every layer has a preallocated cache
        (full attention: no sliding window), and whose modules that the step bypasses (all but
        the embedding, rotary embedding and activations, which it calls) have no hooks and no
        replaced forward: the step would skip them."""
        config = model.config
        if getattr(config, "model_type", None) not in _LLAMA_FAMILY:
            return False
        if getattr(config, "hidden_act", None) != "silu":
            return False
        if not all(type(layer) is PreallocatedLayer for layer in cache.layers):
            return False
        try:
            inner, head = model.model, model.lm_head
            inner.embed_tokens, inner.rotary_emb  # noqa: B018
            norms = [inner.norm]
            bypassed = [model, inner, head, inner.norm]
            for layer in inner.layers:
                attention, mlp = layer.self_attn, layer.mlp
                if {name for name, _ in attention.named_children()} != _ATTENTION_CHILDREN:
                    return False  # e.g. Qwen3's per-head norms
                linears = [getattr(attention, name) for name in sorted(_ATTENTION_CHILDREN)]
                linears += [getattr(mlp, name) for name in _MLP_LINEARS]
                if not all(is_linear(linear) for linear in linears):
                    return False  # e.g. quantized layers (LoRA layers are computed: adapters)
                norms += [layer.input_layernorm, layer.post_attention_layernorm]
                # A LoRA layer's base layer and adapters are bypassed with it.
                parts = [part for linear in linears for part in linear.modules()]
                bypassed += [layer, attention, mlp, *parts, *norms[-2:]]
        except AttributeError:
            return False
        if type(head) is not torch.nn.Linear or len(inner.layers) != len(cache.layers):
            return False
        if any(type(m).__name__ not in _RMS_NORMS for m in norms):
            return False
        return not any(
            m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in bypassed
        )

    def __init__(self, model: Any, batch: int, *, kernel: str | None) -> None:
        """`kernel`: None runs nn.Linear's plain GEMM on the module weights; "onednn" or "mkl"
        packs them (see PackedLinear), for batches of `batch` rows."""

        def project(*modules: torch.nn.Linear) -> _Projection:
            return _Projection(modules, kernel, batch)

        config = model.config
        self._model = model
        self._layers = [
            _LlamaLayer(
                input_norm=_RmsNorm(layer.input_layernorm),
                qkv=project(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                o=project(layer.self_attn.o_proj),
                post_norm=_RmsNorm(layer.post_attention_layernorm),
                gate_up=project(layer.mlp.gate_proj, layer.mlp.up_proj),
                down=project(layer.mlp.down_proj),
                act=layer.mlp.act_fn,
                heads=config.num_attention_heads,
                kv_heads=config.num_key_value_heads,
                head_dim=layer.self_attn.head_dim,
                scaling=layer.self_attn.scaling,
            )
            for layer in model.model.layers
        ]
        self._norm = _RmsNorm(model.model.norm)
        self._head = project(model.lm_head)

    def __call__(
        self,
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DynamicCache,
    ) -> torch.Tensor:
        """A decode step: next-token logits, float32 [B, V], after token_ids [B] at
        position_ids [B, 1]; attention_mask [B, seen] covers the cache and the new token, which
        goes into `cache`."""
        return self.forward(token_ids[:, None], position_ids, attention_mask, cache)

    def forward(
        self,
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DynamicCache,
    ) -> torch.Tensor:
        """Logits, float32 [B, V], after the S tokens token_ids [B, S] at position_ids [B, S]
        (a prefill, or S = 1: a decode step), whose keys and values go into `cache`.
        attention_mask [B, seen] covers the cache and the new tokens."""
        inner = self._model.model
        hidden = inner.embed_tokens(token_ids)  # [B, S, hidden]
        cos, sin = inner.rotary_emb(hidden, position_ids)  # [B, S, head_dim]
        bias = attention_bias(attention_mask, token_ids.shape[1], hidden.dtype)
        cos, sin = cos[:, :, None], sin[:, :, None]  # broadcast over heads
        for layer, layer_cache in zip(self._layers, cache.layers, strict=True):
            hidden = layer(hidden, cos, sin, bias, layer_cache)
        return self._head(self._norm(hidden[:, -1])).float()


def attention_bias(attention_mask: torch.Tensor, new: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention bias [B, 1, S, seen] (0 where a query attends, -inf elsewhere) of
    the last `new` = S of the `seen` columns of attention_mask [B, seen]: a query sees the columns
    of its row's mask up to its own (causal), and always itself.

    Why itself always: a left-padded prompt's padding queries see nothing else; a row of only
    -inf makes attention NaN, and NaN keys and values in the cache would poison later steps even
    behind a mask (0 * NaN). SDPA applies an additive bias faster than a boolean mask."""
    seen = attention_mask.shape[1]
    visible = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, seen]
    if new > 1:
        query = torch.arange(seen - new, seen, device=attention_mask.device)[:, None]
        column = torch.arange(seen, device=attention_mask.device)[None, :]
        visible = (visible & (column <= query)) | (column == query)  # [B, 1, S, seen]
    bias = torch.zeros(visible.shape, dtype=dtype, device=attention_mask.device)
    return bias.masked_fill_(~visible, float("-inf"))


@dataclass(eq=False)
class _LlamaLayer:
    """One decoder layer's weights, and what its forward computes with them."""

    input_norm: _RmsNorm
    qkv: _Projection
    o: _Projection
    post_norm: _RmsNorm
    gate_up: _Projection
    down: _Projection
    act: torch.nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bias: torch.Tensor,
        cache: PreallocatedLayer,
    ) -> torch.Tensor:
        """hidden [B, S, hidden] after this layer; cos, sin [B, S, 1, head_dim]; bias
        [B, 1, S, seen]. The S tokens' keys and values go into `cache`."""
        batch, new, width = hidden.shape
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        group = heads // kv_heads
        x = self.input_norm(hidden).view(batch * new, width)
        qkv = self.qkv(x).view(batch, new, heads + 2 * kv_heads, head_dim)
        # The query and key heads lie side by side: one rotation for both.
        rotated = _rotate(qkv[:, :, : heads + kv_heads], cos, sin)
        q, k, v = rotated[:, :, :heads], rotated[:, :, heads:], qkv[:, :, heads + kv_heads :]
        keys, values = cache.update(k.transpose(1, 2), v.transpose(1, 2))  # [B, kv, seen, D]
        # Grouped-query attention without repeating the keys: the `group` query heads that share
        # a key head become that head's query rows, group-major ([B, kv, group * S, D]), so row
        # g * S + s is query s and its bias row is bias[s]: the bias repeats `group` times.
        grouped = q.reshape(batch, new, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        grouped = grouped.reshape(batch, kv_heads, group * new, head_dim)
        attention = torch.nn.functional.scaled_dot_product_attention(
            grouped,
            keys,
            values,
            attn_mask=bias if new == 1 else bias.repeat(1, 1, group, 1),
            scale=self.scaling,
        )
        attention = attention.view(batch, kv_heads, group, new, head_dim).permute(0, 3, 1, 2, 4)
        attended = self.o(attention.reshape(batch * new, heads * head_dim))
        hidden = hidden + attended.view(batch, new, width)
        x = self.post_norm(hidden).view(batch * new, width)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return hidden + self.down(self.act(gate) * up).view(batch, new, width)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers' Llama applies it: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class _RmsNorm:
    """A Llama-family RMSNorm module's computation as torch's one fused rms_norm op (the module
    runs about seven ops). Other dtypes than float32 call the module: it rounds in between."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._module.weight
        if x.dtype != torch.float32 or weight.dtype != torch.float32:
            return self._module(x)
        eps = self._module.variance_epsilon
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


class _Projection:
    """Linear layers applied to one input, their outputs side by side [B, sum of out_features].

    With oneDNN they are one GEMM over their stacked weights (packed anyway, so stacking costs no
    memory for long); otherwise each layer is its own PackedLinear and the outputs are joined.
    LoRA layers (rollout.engines.hf.adapters) are packed merged, or run their adapters beside
    the plain GEMM."""

    def __init__(self, modules: Sequence[torch.nn.Module], kernel: str | None, rows: int) -> None:
        bases = [base_linear(m) for m in modules]
        # Packing copies the weights anyway: it takes them merged. The plain GEMM keeps the
        # base weight and adds each adapter's low-rank product.
        weights = [
            effective_weight(m) if kernel else b.weight for m, b in zip(modules, bases, strict=True)
        ]
        self._adapters: list[list[LowRank]] = [[] if kernel else low_ranks(m) for m in modules]
        if kernel == "onednn" and len(modules) > 1:
            weight = torch.cat(weights)
            bias = None
            if any(b.bias is not None for b in bases):
                bias = torch.cat(
                    [
                        b.weight.new_zeros(b.out_features) if b.bias is None else b.bias
                        for b in bases
                    ]
                )
            self._linears = [PackedLinear(weight, bias, kernel, rows)]
        else:
            self._linears = [
                PackedLinear(w, b.bias, kernel, rows) for w, b in zip(weights, bases, strict=True)
            ]
        if not any(self._adapters):
            self._adapters = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._adapters:
            outputs = [
                adapted_output(x, linear(x), terms)
                for linear, terms in zip(self._linears, self._adapters, strict=True)
            ]
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        if len(self._linears) == 1:
            return self._linears[0](x)
        return torch.cat([linear(x) for linear in self._linears], dim=-1)
