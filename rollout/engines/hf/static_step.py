"""StaticDecoder: a Llama-family decode step whose every tensor has a fixed shape and address, so
that a CUDA graph can capture it once per batch width and replay it for every token.

The cache is slotted: `width` slots (one per row), each with `capacity` columns, in one buffer
per keys and values [layers, width, kv_heads, capacity, head_dim] allocated once. A row's prompt
lies in columns 0 .. P-1 of its slot and its n-th token goes into column P + n - 1: every row
writes at its own column (`lengths`, a device tensor), so rows of any length share a step and a
finished slot is refilled by writing a prompt into it, with nothing else moved.

One decode step, for the first `width` slots (a width bucket) attending to their first `span`
columns (a span bucket), all on the device and without a host sync:

    sample a token per row from `logits` (sample_rows_on_device; each row's uniform draw is
    counter_uniform of its random stream and its count of sampled tokens) -> write the token and
    its log-prob into the ring at `ring_at` -> feed the token: its keys and values go into column
    `lengths`, attention runs over the columns up to it -> `logits` for the next step.

The host reads the ring every few steps (StaticDecodeBatch). A row that finished meanwhile keeps
running until then: its writes are clamped into its own slot's last spanned column, and what it
samples is dropped. The prefill of new prompts runs outside the captured step and writes into
the slots it fills.

Weights: the step reads the model's parameters where they are (so an in-place update, as
load_state_dict or an optimizer makes, is what the next replay sees), except the q/k/v and
gate/up projections, which are stacked into one GEMM each over a copy (refreshed in place when
the weights change) for models up to FUSE_MAX_BYTES. A parameter that moved (`.to()`, a new
tensor) changes `weights_fingerprint`: the captured graphs are then dropped and recaptured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rollout.engines.hf.adapters import is_lora_linear
from rollout.engines.hf.cuda_graphs import CapturedSteps
from rollout.engines.hf.kv_cache import preallocated_cache
from rollout.engines.hf.llama_decoder import LlamaDecoder
from rollout.engines.hf.prompts import distinct_prompts
from rollout.engines.sampling import counter_uniform, sample_rows_on_device

FUSE_MAX_BYTES = 2 * 1024**3
"""Largest stacked copy (q/k/v and gate/up weights, in bytes) made for one GEMM each: above it
the step runs one GEMM per projection on the model's own weights, rather than hold the copy."""

CAPACITY_STEP = 64
"""Cache columns are allocated in multiples of this (attention kernels want aligned rows)."""

SPAN_MIN = 64
"""Narrowest span bucket: attention runs over 64, 128, 256, ... columns (at most capacity)."""

RING_STEPS = 8
"""Decode steps whose tokens the device holds between two host reads."""

_SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")
"""Rotary types whose frequencies change with the sequence length: no table computed once."""


def supports_static(model: Any) -> bool:
    """Whether the static step computes what `model` computes: a Llama-family model that the
    written-out step serves (LlamaDecoder.supports: full attention, plain linears, no hooks on
    bypassed modules) with a rotary table that does not depend on the sequence length.

    LoRA layers are refused although LlamaDecoder composes them: the static step stacks and
    reads the base weights (`m.weight` of a peft layer is its base layer's), so it would sample
    from the model without its adapters. An adapted model takes the dynamic path."""
    if not LlamaDecoder.supports(model, preallocated_cache(model.config, 1)):
        return False
    if any(is_lora_linear(module) for module in model.modules()):
        return False
    rope = getattr(model.config, "rope_parameters", None) or getattr(
        model.config, "rope_scaling", None
    )
    kind = str((rope or {}).get("rope_type", (rope or {}).get("type", "default")))
    return not any(part in kind for part in _SEQUENCE_DEPENDENT_ROPE)


def round_capacity(columns: int) -> int:
    return -(-columns // CAPACITY_STEP) * CAPACITY_STEP


def span_bucket(columns: int, capacity: int) -> int:
    """The span bucket for rows that reach `columns` columns: a power of two from SPAN_MIN,
    at most `capacity`."""
    return min(max(SPAN_MIN, 1 << max(columns - 1, 0).bit_length()), capacity)


@dataclass(frozen=True)
class RowSetup:
    """What a slot needs to start a row: its prompt, its random stream and its sampling."""

    prompt: list[int]
    stream: int
    temperature: float
    top_k: int
    top_p: float


class StaticDecoder:
    """The static cache, the per-row device state and the decode step over them (module
    docstring); captured in CUDA graphs per (width, span, sampling variant) when `graphs`."""

    def __init__(
        self, model: Any, *, width: int, capacity: int, device: torch.device, graphs: bool
    ) -> None:
        config = model.config
        self._model = model
        self.device = device
        self.dtype = model.lm_head.weight.dtype
        self.width, self.capacity = width, round_capacity(capacity)
        self._heads = config.num_attention_heads
        self._kv_heads = config.num_key_value_heads
        attention = model.model.layers[0].self_attn
        self._head_dim = attention.head_dim
        self._scaling = attention.scaling
        self._weights = _Weights(model)
        self.weights_fingerprint = fingerprint(model)
        self._graphs = CapturedSteps(device) if graphs else None
        self._allocate(width, self.capacity)

    # --- state ------------------------------------------------------------------------------

    def _allocate(self, width: int, capacity: int) -> None:
        """Fresh buffers for `width` slots of `capacity` columns (zeroed: attention multiplies
        masked values by 0, and 0 * NaN from uninitialized memory would survive)."""
        layers = len(self._model.model.layers)
        device, dtype = self.device, self.dtype
        shape = (layers, width, self._kv_heads, capacity, self._head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        vocabulary = self._model.lm_head.weight.shape[0]
        self.logits = torch.zeros(width, vocabulary, dtype=torch.float32, device=device)
        self.lengths = torch.zeros(width, dtype=torch.long, device=device)
        """[width]: the cache columns each slot holds; its next token goes into this one."""
        self.generated = torch.zeros(width, dtype=torch.long, device=device)
        """[width]: tokens each slot has sampled: the counter of its random stream."""
        self.stream = torch.zeros(width, dtype=torch.long, device=device)
        self.temperature = torch.ones(width, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(width, dtype=torch.long, device=device)
        self.top_p = torch.ones(width, dtype=torch.float32, device=device)
        self.ring_tokens = torch.zeros(RING_STEPS, width, dtype=torch.long, device=device)
        self.ring_logprobs = torch.zeros(RING_STEPS, width, dtype=torch.float32, device=device)
        self.ring_top_ids = torch.zeros(RING_STEPS, width, 0, dtype=torch.long, device=device)
        self.ring_top_logprobs = torch.zeros(RING_STEPS, width, 0, device=device)
        self.ring_at = torch.zeros(1, dtype=torch.long, device=device)
        """Where the next step writes in the ring; the host sets it back to 0 as it reads."""
        self._columns = torch.arange(capacity, device=device)
        self._zero = torch.zeros((), dtype=dtype, device=device)
        self._minus_inf = torch.full((), float("-inf"), dtype=dtype, device=device)
        positions = torch.arange(capacity, device=device)[None]
        probe = torch.zeros(1, capacity, 1, dtype=dtype, device=device)
        cos, sin = self._model.model.rotary_emb(probe, positions)  # [1, capacity, head_dim]
        half = self._head_dim // 2
        sign = torch.ones(self._head_dim, dtype=dtype, device=device)
        sign[:half] = -1
        # rotate_half(x) * sin is x with its halves swapped, times sin with its first half negated.
        self._cos, self._sin = cos[0], sin[0] * sign

    def resize(self, width: int, capacity: int) -> None:
        """Room for `width` slots of `capacity` columns (at least), keeping what the slots hold;
        the captured steps read the old buffers, so they are dropped."""
        width, capacity = max(width, self.width), max(round_capacity(capacity), self.capacity)
        if (width, capacity) == (self.width, self.capacity):
            return
        old = self.__dict__.copy()
        self._allocate(width, capacity)
        slots, columns = old["width"], old["capacity"]
        self.keys[:, :slots, :, :columns] = old["keys"]
        self.values[:, :slots, :, :columns] = old["values"]
        for name in ("logits", "lengths", "generated", "stream", "temperature", "top_k", "top_p"):
            getattr(self, name)[:slots] = old[name]
        self.width, self.capacity = width, capacity
        if self._graphs is not None:
            self._graphs.clear()

    def ensure_alternatives(self, count: int) -> None:
        """Ring room for `count` alternatives per token (new buffers, and the steps that wrote
        the old ones dropped, when it grows)."""
        if count <= self.ring_top_ids.shape[-1]:
            return
        count = min(1 << (count - 1).bit_length(), self.logits.shape[-1])
        shape = (RING_STEPS, self.width, count)
        self.ring_top_ids = torch.zeros(shape, dtype=torch.long, device=self.device)
        self.ring_top_logprobs = torch.zeros(shape, dtype=torch.float32, device=self.device)
        if self._graphs is not None:
            self._graphs.drop(lambda key: key[3] > 0)

    def follow_weights(self, reloaded: bool) -> None:
        """Keep reading the model's current weights: if a parameter moved (a new tensor, a
        `.to()`), read the new ones and drop the captured steps (they read the old addresses);
        else, after a reload (`reloaded`), refresh the stacked copies in place."""
        now = fingerprint(self._model)
        if now != self.weights_fingerprint:
            if self._graphs is not None:
                self._graphs.clear()
            self._weights = _Weights(self._model)
            self.weights_fingerprint = now
        elif reloaded:
            self._weights.refresh()

    def move(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Copy slots `sources` into slots `targets` (compaction into a narrower bucket)."""
        source = torch.tensor(list(sources), device=self.device)
        target = torch.tensor(list(targets), device=self.device)
        self.keys[:, target] = self.keys[:, source]
        self.values[:, target] = self.values[:, source]
        for name in ("logits", "lengths", "generated", "stream", "temperature", "top_k", "top_p"):
            tensor = getattr(self, name)
            tensor[target] = tensor[source]

    @property
    def captures(self) -> tuple[int, float]:
        """(graphs captured, seconds spent capturing them) so far."""
        if self._graphs is None:
            return 0, 0.0
        return self._graphs.captures, self._graphs.capture_seconds

    # --- the prefill --------------------------------------------------------------------------

    def prefill(self, slots: Sequence[int], rows: Sequence[RowSetup], pad_token_id: int) -> None:
        """Run the prompts of `rows` (once per distinct prompt) and start them in `slots`: their
        keys and values in columns 0 .. P-1, their next-token logits, lengths, counters, streams
        and sampling parameters."""
        distinct, which = distinct_prompts([row.prompt for row in rows])
        device, weights = self.device, self._weights
        lengths = [len(prompt) for prompt in distinct]
        width = max(lengths)
        ids = torch.full((len(distinct), width), pad_token_id, dtype=torch.long, device="cpu")
        for index, prompt in enumerate(distinct):  # right-padded: causal attention ignores it
            ids[index, : len(prompt)] = torch.tensor(prompt, dtype=torch.long, device="cpu")
        ids = ids.to(device)
        target = torch.tensor(list(slots), device=device)
        source = torch.tensor(which, device=device)
        heads, kv_heads, head_dim = self._heads, self._kv_heads, self._head_dim
        batch = len(distinct)
        hidden = self._model.model.embed_tokens(ids)  # [n, P, hidden]
        cos, sin = self._cos[None, :width, None], self._sin[None, :width, None]
        for index, layer in enumerate(weights.layers):
            x = F.rms_norm(hidden, layer.input_norm.shape, layer.input_norm, layer.input_eps)
            qkv = layer.qkv(x).view(batch, width, heads + 2 * kv_heads, head_dim)
            rotated = _rotate(qkv[:, :, : heads + kv_heads], cos, sin)
            q = rotated[:, :, :heads].transpose(1, 2)  # [n, heads, P, D]
            k = rotated[:, :, heads:].transpose(1, 2)  # [n, kv, P, D]
            v = qkv[:, :, heads + kv_heads :].transpose(1, 2)
            self.keys[index, target, :, :width] = k[source]
            self.values[index, target, :, :width] = v[source]
            attention = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self._scaling, enable_gqa=heads != kv_heads
            )
            attended = attention.transpose(1, 2).reshape(batch, width, heads * head_dim)
            hidden = layer.block_tail(hidden, attended)
        last = hidden[torch.arange(batch, device=device), torch.tensor(lengths, device=device) - 1]
        self.logits[target] = weights.head(last)[source]
        self.lengths[target] = torch.tensor(lengths, device=device)[source]
        self.generated[target] = 0
        host = {
            "stream": ([row.stream for row in rows], torch.long),
            "temperature": ([row.temperature for row in rows], torch.float32),
            "top_k": ([row.top_k for row in rows], torch.long),
            "top_p": ([row.top_p for row in rows], torch.float32),
        }
        for name, (values, dtype) in host.items():
            getattr(self, name)[target] = torch.tensor(values, dtype=dtype, device=device)

    # --- the decode step ----------------------------------------------------------------------

    def decode(self, width: int, span: int, *, truncating: bool, alternatives: int) -> None:
        """One decode step for slots 0 .. width-1 over columns 0 .. span-1 (module docstring):
        replayed from its CUDA graph when graphs are on (captured at the first call of this
        width, span and sampling variant), else run as is."""
        if self._graphs is None:
            self._step(width, span, truncating, alternatives)
            return
        self._graphs.run(
            (width, span, truncating, alternatives),
            lambda: self._step(width, span, truncating, alternatives),
            save=lambda: self._save(width),
            restore=lambda saved: self._restore(width, saved),
        )

    def _step(self, width: int, span: int, truncating: bool, alternatives: int) -> None:
        sampled = sample_rows_on_device(
            self.logits[:width],
            self.temperature[:width],
            self.top_k[:width],
            self.top_p[:width],
            counter_uniform(self.stream[:width], self.generated[:width]),
            truncating=truncating,
            top=alternatives,
        )
        at = self.ring_at
        self.ring_tokens[:, :width].index_copy_(0, at, sampled.token_ids[None])
        self.ring_logprobs[:, :width].index_copy_(0, at, sampled.logprobs[None])
        if sampled.top is not None:
            count = sampled.top.token_ids.shape[-1]
            self.ring_top_ids[:, :width, :count].index_copy_(0, at, sampled.top.token_ids[None])
            self.ring_top_logprobs[:, :width, :count].index_copy_(0, at, sampled.top.logprobs[None])
        at += 1
        self.generated[:width] += 1
        self.logits[:width] = self._feed(sampled.token_ids, width, span)

    def _feed(self, token_ids: torch.Tensor, width: int, span: int) -> torch.Tensor:
        """Next-token logits, float32 [width, V], after token_ids [width] at each slot's column."""
        heads, kv_heads, head_dim = self._heads, self._kv_heads, self._head_dim
        lengths = self.lengths[:width]
        # A row the host has not yet seen finish may run past its last column: it stays inside.
        column = lengths.clamp(max=span - 1)
        hidden = self._model.model.embed_tokens(token_ids)  # [width, hidden]
        cos, sin = self._cos[column][:, None], self._sin[column][:, None]  # [width, 1, D]
        visible = self._columns[None, :span] <= column[:, None]
        bias = torch.where(visible, self._zero, self._minus_inf)[:, None, None]  # [w, 1, 1, span]
        where = column[:, None, None, None].expand(width, kv_heads, 1, head_dim)
        for index, layer in enumerate(self._weights.layers):
            x = F.rms_norm(hidden, layer.input_norm.shape, layer.input_norm, layer.input_eps)
            qkv = layer.qkv(x).view(width, heads + 2 * kv_heads, head_dim)
            rotated = _rotate(qkv[:, : heads + kv_heads], cos, sin)
            keys, values = self.keys[index, :width], self.values[index, :width]
            keys.scatter_(2, where, rotated[:, heads:, None])
            values.scatter_(2, where, qkv[:, heads + kv_heads :, None])
            # The `group` query heads of a kv head attend as one [group, D] query block.
            grouped = rotated[:, :heads].reshape(width, kv_heads, heads // kv_heads, head_dim)
            attention = F.scaled_dot_product_attention(
                grouped,
                keys[:, :, :span],
                values[:, :, :span],
                attn_mask=bias,
                scale=self._scaling,
            )
            hidden = layer.block_tail(hidden, attention.reshape(width, heads * head_dim))
        lengths += 1
        return self._weights.head(hidden)

    def _save(self, width: int) -> tuple[torch.Tensor, ...]:
        """The state a step changes, before a capture's warm-up run changes it."""
        state = (self.lengths, self.generated, self.ring_at, self.logits[:width])
        return tuple(tensor.clone() for tensor in state)

    def _restore(self, width: int, saved: tuple[torch.Tensor, ...]) -> None:
        """The state back as before the warm-up run. The cache column and ring entry it wrote
        are written again, alike, by the real step."""
        for tensor, value in zip(
            (self.lengths, self.generated, self.ring_at, self.logits[:width]), saved, strict=True
        ):
            tensor.copy_(value)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: x * cos + rotate_half(x) * sin, with `sin` pre-signed (its first half
    negated), so that rotate_half is a swap of the halves."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def fingerprint(model: Any) -> tuple[tuple[int, torch.dtype, tuple[int, ...]], ...]:
    """Where each parameter lives (address, dtype, shape): what a captured step reads."""
    return tuple(
        (parameter.data_ptr(), parameter.dtype, tuple(parameter.shape))
        for parameter in model.parameters()
    )


class _Stacked:
    """Linear layers applied to one input, outputs side by side [.., sum of out_features]:
    one GEMM over a stacked copy of their weights when `fuse`, else one each (on the modules'
    own weights)."""

    def __init__(self, modules: Sequence[torch.nn.Linear], fuse: bool) -> None:
        self._modules = list(modules)
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        if fuse and len(self._modules) > 1:
            self._weight = torch.cat([m.weight.detach() for m in self._modules])
            if any(m.bias is not None for m in self._modules):
                self._bias = torch.cat(self._biases())

    def _biases(self) -> list[torch.Tensor]:
        return [
            m.weight.new_zeros(m.out_features) if m.bias is None else m.bias.detach()
            for m in self._modules
        ]

    def refresh(self) -> None:
        """The stacked copy made again from the modules' weights, in place (same address)."""
        if self._weight is not None:
            torch.cat([m.weight.detach() for m in self._modules], out=self._weight)
            if self._bias is not None:
                torch.cat(self._biases(), out=self._bias)

    def added_to(self, base: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """base + self(x): for one layer without a bias, one GEMM that adds `base` as it
        writes (a kernel fewer per residual connection)."""
        if len(self._modules) > 1 or self._modules[0].bias is not None:
            return base + self(x)
        weight = self._modules[0].weight
        flat = torch.addmm(base.reshape(-1, base.shape[-1]), x.reshape(-1, x.shape[-1]), weight.t())
        return flat.view(base.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._weight is not None:
            return F.linear(x, self._weight, self._bias)
        if len(self._modules) == 1:
            return F.linear(x, self._modules[0].weight, self._modules[0].bias)
        return torch.cat([F.linear(x, m.weight, m.bias) for m in self._modules], dim=-1)


@dataclass(eq=False)
class _Layer:
    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: _Stacked
    o: _Stacked
    gate_up: _Stacked
    down: _Stacked
    act: Callable[[torch.Tensor], torch.Tensor]

    def block_tail(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """hidden after the layer, given its attention's output (heads side by side)."""
        hidden = self.o.added_to(hidden, attended)
        x = F.rms_norm(hidden, self.post_norm.shape, self.post_norm, self.post_eps)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down.added_to(hidden, self.act(gate) * up)


class _Weights:
    """The model's weights as the step reads them (module docstring)."""

    def __init__(self, model: Any) -> None:
        layers = model.model.layers
        stacked = sum(
            m.weight.numel() * m.weight.element_size()
            for layer in layers
            for m in (
                layer.self_attn.q_proj,
                layer.self_attn.k_proj,
                layer.self_attn.v_proj,
                layer.mlp.gate_proj,
                layer.mlp.up_proj,
            )
        )
        fuse = stacked <= FUSE_MAX_BYTES
        self.layers = [
            _Layer(
                input_norm=layer.input_layernorm.weight,
                input_eps=layer.input_layernorm.variance_epsilon,
                post_norm=layer.post_attention_layernorm.weight,
                post_eps=layer.post_attention_layernorm.variance_epsilon,
                qkv=_Stacked(
                    [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], fuse
                ),
                o=_Stacked([layer.self_attn.o_proj], fuse),
                gate_up=_Stacked([layer.mlp.gate_proj, layer.mlp.up_proj], fuse),
                down=_Stacked([layer.mlp.down_proj], fuse),
                act=layer.mlp.act_fn,
            )
            for layer in layers
        ]
        self._norm = model.model.norm
        self._head = _Stacked([model.lm_head], fuse)

    def refresh(self) -> None:
        for layer in self.layers:
            layer.qkv.refresh()
            layer.gate_up.refresh()

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of hidden states [.., hidden] after the final norm."""
        norm = self._norm
        x = F.rms_norm(hidden, norm.weight.shape, norm.weight, norm.variance_epsilon)
        return self._head(x).float()
