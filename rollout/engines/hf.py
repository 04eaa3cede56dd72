"""The embedded engine: batched sampling with a KV cache on a transformers causal LM.

One chunk of up to max_batch_size completions runs at a time: left-padded prompts, one prefill
forward (once per distinct prompt), then one decode step per new token that feeds only that token
and reuses the cache. The whole chunk is sampled in one pass per step; rows that finished keep
being fed padding and are ignored. (Continuous batching, refilling finished rows with new prompts,
is for later.)

Speed on CPU, where a decode step at a small batch is bound by streaming the weights: the KV cache
is preallocated for the chunk, sampling draws one uniform number per row (sample_tokens), and
Llama-family models (llama, mistral, qwen2) decode through LlamaDecoder, a step written out in
plain torch on MKL-packed weights; other models run their own forward at every step.

What a Completion carries, precisely (the learner depends on it):
- token_ids are the sampled tokens; an eos token that ended the completion is included (so the
  policy learns to stop), a stop string and the tokens that make it are not.
- logprobs[i] is log_softmax(logits / T)[token_ids[i]] in float32, T the temperature (T=1 when
  greedy), computed BEFORE top-k/top-p truncation: the learner recomputes exactly this from one
  forward over prompt + completion.
- text is the decoded completion without special tokens, cut before the first stop string.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rollout.engines.base import Completion, EngineStats, FinishReason, SamplingParams

# A character is at most 4 UTF-8 bytes and every token carries at least one byte, so a stop string
# of c characters lies within its last 4c tokens; one more covers a character split across tokens.
_BYTES_PER_CHAR = 4


@dataclass
class _Row:
    """One completion while it is being sampled."""

    prompt_index: int
    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None


class HfEngine:
    """The Engine Protocol (rollout.engines.base) on a transformers model in this process."""

    def __init__(
        self,
        model: Any,
        *,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        tokenizer: Any,
        max_batch_size: int | None = None,
        device: str | torch.device = "cpu",
        seed: int | None = None,
    ) -> None:
        """`model` is used in place (it may be the learner's own module). `seed` seeds the
        engine's generator, used when SamplingParams.seed is None; None draws a random seed."""
        if not eos_token_ids:
            raise ValueError("eos_token_ids is empty: the engine needs a token that ends a turn")
        self._model = model
        self._eos = frozenset(eos_token_ids)
        self._pad = pad_token_id
        self._tokenizer = tokenizer
        self._max_batch_size = max_batch_size
        self._device = torch.device(device)
        self._generator = torch.Generator(self._device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._version = 0
        self._stats = EngineStats()

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def stats(self) -> EngineStats:
        return self._stats

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        """`params.n` completions per prompt, grouped by prompt (prompt 0's n first)."""
        if any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("a prompt has no tokens: every prompt needs at least one")
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(self._device).manual_seed(params.seed)
        rows = [
            _Row(index, list(prompt))
            for index, prompt in enumerate(prompts)
            for _ in range(params.n)
        ]
        size = self._max_batch_size or max(len(rows), 1)
        start = time.perf_counter()
        with _eval_mode(self._model), torch.inference_mode():
            for begin in range(0, len(rows), size):
                self._sample(rows[begin : begin + size], params, generator)
        self._stats.seconds += time.perf_counter() - start
        self._stats.prompt_tokens += sum(len(row.prompt) for row in rows)
        self._stats.generated_tokens += sum(len(row.token_ids) for row in rows)
        return [self._completion(row, params) for row in rows]

    def generate_one(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[Completion]:
        """The `params.n` completions of one prompt."""
        return self.generate([prompt_ids], params)

    def load_weights(self, weights: Mapping[str, torch.Tensor] | None, version: int) -> None:
        """New weights from the learner; None when the module is shared and already up to date."""
        if weights is not None:
            self._model.load_state_dict(dict(weights), strict=True)
        self._version = version

    def close(self) -> None:
        """Nothing to release: the model belongs to the caller."""

    # --- sampling --------------------------------------------------------------------------------

    def _sample(self, rows: list[_Row], params: SamplingParams, generator: torch.Generator) -> None:
        """Fill in the rows' tokens, log-probs and finish reasons: one prefill, then one step per
        new token until every row has finished or max_new_tokens is reached."""
        logits, cache, attention_mask, position_ids = self._prefill(rows, params.max_new_tokens)
        decode = self._decoder(cache, len(rows), params.max_new_tokens)
        seen = attention_mask.shape[1] - params.max_new_tokens
        for step in range(params.max_new_tokens):
            token_ids, logprobs = sample_tokens(logits, params, generator)
            self._record(rows, token_ids.tolist(), logprobs.tolist(), params.stop)
            active = [row.finish_reason is None for row in rows]
            if not any(active) or step == params.max_new_tokens - 1:
                break
            # Finished rows are fed padding: their outputs are ignored from here on.
            feed = token_ids.masked_fill(~torch.tensor(active, device=self._device), self._pad)
            position_ids = position_ids[:, -1:] + 1
            seen += 1
            logits = decode(feed, position_ids, attention_mask[:, :seen])
        for row in rows:
            if row.finish_reason is None:
                row.finish_reason = "length"

    def _prefill(
        self, rows: list[_Row], max_new_tokens: int
    ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
        """Run the prompts: (next-token logits [B, V], the cache, the attention mask [B, P + N] for
        the whole chunk, the prompts' position ids [B, P]), P the padded prompt width."""
        # Each distinct prompt is prefilled once (GRPO samples n completions of every prompt); its
        # cache and next-token logits are then copied to all of its rows.
        distinct, row_prompt = _distinct([row.prompt for row in rows])
        input_ids, prompt_mask = left_pad(distinct, self._pad, self._device)
        # Left padding shifts each prompt right; positions count real tokens only, so every row
        # sees the positions it would see alone (and that the learner's right-padded forward uses).
        position_ids = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        cache = preallocated_cache(self._model.config, input_ids.shape[1] + max_new_tokens)
        logits = self._forward(input_ids, prompt_mask, position_ids, cache)
        if len(distinct) < len(rows):
            index = torch.tensor(row_prompt, device=self._device)
            cache.batch_select_indices(index)
            logits = logits[index]
            prompt_mask = prompt_mask[index]
            position_ids = position_ids[index]
        # The mask for the whole chunk, made once: each step passes a longer view of it (every
        # row attends to every token fed; a finished row's outputs are ignored anyway).
        attention_mask = torch.cat(
            [prompt_mask, prompt_mask.new_ones(len(rows), max_new_tokens)], 1
        )
        return logits, cache, attention_mask, position_ids

    def _decoder(
        self, cache: DynamicCache, batch: int, max_new_tokens: int
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """The decode step: (token ids [B], position ids [B, 1], attention mask [B, seen]) ->
        next-token logits [B, V], extending `cache`. A Llama-family model gets its step written
        out here (LlamaDecoder); any other model runs its own forward."""
        if LlamaDecoder.supports(self._model, cache):
            pack = should_pack(self._model, max_new_tokens)
            return LlamaDecoder(self._model, cache, batch, pack=pack)

        def step(
            token_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor
        ) -> torch.Tensor:
            return self._forward(token_ids[:, None], mask, position_ids, cache)

        return step

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
    ) -> torch.Tensor:
        """Logits for the next token, float32 [B, V], from input_ids [B, S] after the cache.

        attention_mask [B, cached + S] covers the cache too; position_ids is [B, S].
        """
        output = self._model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,  # the prefill needs only the last position's [B, V], not [B, S, V]
        )
        return output.logits[:, -1].float()

    def _record(
        self, rows: list[_Row], token_ids: list[int], logprobs: list[float], stop: tuple[str, ...]
    ) -> None:
        """Append one sampled token to each unfinished row and note the rows that just finished."""
        for row, token_id, logprob in zip(rows, token_ids, logprobs, strict=True):
            if row.finish_reason is not None:
                continue
            row.token_ids.append(token_id)
            row.logprobs.append(logprob)
            if token_id in self._eos:
                row.finish_reason = "eos"
            elif stop and self._ends_with_stop(row.token_ids, stop):
                row.finish_reason = "stop"

    def _ends_with_stop(self, token_ids: list[int], stop: tuple[str, ...]) -> bool:
        """Whether the newest token completed a stop string. Earlier tokens were checked at their
        own step, so only the last few tokens' text needs decoding."""
        window = _BYTES_PER_CHAR * max(len(s) for s in stop) + 1
        tail = self._decode(token_ids[-window:])
        return any(s in tail for s in stop)

    # --- results ---------------------------------------------------------------------------------

    def _completion(self, row: _Row, params: SamplingParams) -> Completion:
        assert row.finish_reason is not None
        token_ids, logprobs = row.token_ids, row.logprobs
        if row.finish_reason == "stop":
            keep, text = cut_at_stop(token_ids, params.stop, self._decode)
            token_ids, logprobs = token_ids[:keep], logprobs[:keep]
        else:
            text = self._decode(token_ids)
        return Completion(
            prompt_index=row.prompt_index,
            token_ids=token_ids,
            logprobs=logprobs,
            text=text,
            finish_reason=row.finish_reason,
            policy_version=self._version,
        )

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits [B, V]: (token ids [B], their log-probs [B]).

    The log-prob is under log_softmax(logits / T) before top-k/top-p truncation; temperature 0
    is greedy and reports T=1 log-probs.
    """
    temperature = params.temperature if params.temperature > 0 else 1.0
    scaled = logits if temperature == 1.0 else logits / temperature
    # log_softmax(scaled)[token] is scaled[token] - logsumexp(scaled): one reduction over the
    # vocabulary rather than a [B, V] log-prob tensor, and the exponentials are reused to sample.
    peak = scaled.amax(-1, keepdim=True)
    weights = (scaled - peak).exp_()  # probabilities up to a factor per row
    log_normalizer = weights.sum(-1, keepdim=True).log_() + peak
    if params.temperature > 0:
        if 0 < params.top_k < logits.shape[-1] or params.top_p < 1.0:
            truncated = truncate(scaled, top_k=params.top_k, top_p=params.top_p)
            weights = (truncated - peak).exp_()  # -inf, the truncated tokens, becomes weight 0
        token_ids = sample_proportional(weights, generator)
    else:
        token_ids = scaled.argmax(-1)
    logprobs = (scaled.gather(-1, token_ids[:, None]) - log_normalizer).squeeze(-1)
    return token_ids, logprobs


def sample_proportional(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of weights [B, V] (>= 0, not all 0), drawn with probability
    proportional to its weight; a weight of 0 is never drawn.

    Inverse CDF: one uniform draw per row located in the running sum of the weights. It draws what
    torch.multinomial draws, but multinomial spends one random number per vocabulary entry,
    which costs more than the rest of sampling together on a 50k vocabulary.
    """
    cdf = weights.cumsum(-1)
    total = cdf[:, -1:].contiguous()  # searchsorted copies a non-contiguous argument anyway
    uniform = torch.rand(total.shape, generator=generator, device=weights.device, dtype=cdf.dtype)
    index = torch.searchsorted(cdf, uniform * total, right=True)
    # Rounding can put uniform * total at the total itself; the last index with a weight is
    # where the running sum first reaches the total.
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(index, last).squeeze(-1)


def truncate(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """logits [B, V] with everything outside the top k and outside the top-p nucleus at -inf.

    top_k 0 (or >= V) and top_p 1 keep everything. The nucleus is the smallest set of most likely
    tokens whose probability reaches top_p; the most likely token is always kept.
    """
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # probability of the tokens ranked above each one
        drop_sorted = before >= top_p
        drop_sorted[:, 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _distinct(prompts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts in order of first appearance, and which of them each prompt is."""
    first: dict[tuple[int, ...], int] = {}
    which = [first.setdefault(tuple(prompt), len(first)) for prompt in prompts]
    return [list(prompt) for prompt in first], which


def left_pad(
    prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts padded on the left to one width: (input_ids [B, P], attention_mask [B, P])."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def cut_at_stop(
    token_ids: Sequence[int], stop: Sequence[str], decode: Callable[[Sequence[int]], str]
) -> tuple[int, str]:
    """Cut a completion before its first stop string: (tokens to keep, text before the stop).

    Keeps the longest prefix of token_ids whose text lies within the text before the stop. When
    a token straddles the start of the stop string, it is dropped and the text keeps its first
    part, so the text can then run a few characters past decode(token_ids[:keep]).
    """
    text = decode(token_ids)
    found = [at for at in (text.find(s) for s in stop) if at >= 0]
    if not found:
        return len(token_ids), text
    text = text[: min(found)]
    keep = len(token_ids)
    while keep and not text.startswith(decode(token_ids[:keep])):
        keep -= 1
    return keep, text


def preallocated_cache(config: Any, capacity: int) -> DynamicCache:
    """A DynamicCache for the model's config whose full-attention layers hold up to `capacity`
    positions in buffers allocated once (sliding-window and other layer kinds are left as is)."""
    cache = DynamicCache(config=config)
    cache.layers = [
        _PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer
        for layer in cache.layers
    ]
    return cache


class _PreallocatedLayer(DynamicLayer):
    """A DynamicLayer that writes each step's keys and values into buffers sized for the whole
    chunk, where DynamicLayer concatenates: that copies the layer's whole cache at every step.
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


# --- a written-out decode step for Llama-family models ------------------------------------------

PACK_MIN_NEW_TOKENS = 16
"""Shortest generation worth packing the weights for: packing costs about as much time as ten
decode steps of SmolLM2 at batch 8 save with it (it mostly pays for fresh memory pages)."""

PACK_MAX_BYTES = 2 * 1024**3
"""Largest model (its 2-D weights, in bytes) to pack: the packed copy lives beside the weights
while a chunk is sampled, memory that the plan's estimate does not count."""

_LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2"})
"""model_types whose decoder layer is exactly what LlamaDecoder computes: pre-norm, q/k/v/o
projections (biases allowed) with rotary embeddings and grouped-query attention, gated MLP."""

_ATTENTION_CHILDREN = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


class LlamaDecoder:
    """One decode step of a Llama-family model in plain torch, over the model's own weights and
    modules (norms, rotary embedding, activation) and the chunk's preallocated cache.

    Why: at batch 8 on CPU, transformers' per-module Python, mask building and cache bookkeeping
    cost about a fifth of a step; this is about 15 tensor ops per layer. And with pack=True the
    linear layers use MKL's packed GEMM, packed once for the chunk's batch size: the plain sgemm
    that nn.Linear calls re-packs the whole weight on every call, which makes a step with a few
    rows about twice as slow as streaming the weights. The prefill still runs the model itself.
    """

    @staticmethod
    def supports(model: Any, cache: DynamicCache) -> bool:
        """Whether `model` is a Llama-family causal LM whose every layer has a preallocated cache
        (full attention: no sliding window), and whose modules that the step bypasses (all but
        the embedding, rotary embedding, norms and activations, which it calls) have no hooks
        and no replaced forward: the step would skip them."""
        config = model.config
        if getattr(config, "model_type", None) not in _LLAMA_FAMILY:
            return False
        if getattr(config, "hidden_act", None) != "silu":
            return False
        if not all(type(layer) is _PreallocatedLayer for layer in cache.layers):
            return False
        try:
            inner, head = model.model, model.lm_head
            inner.embed_tokens, inner.rotary_emb, inner.norm  # noqa: B018
            bypassed = [model, inner, head]
            for layer in inner.layers:
                attention, mlp = layer.self_attn, layer.mlp
                if {name for name, _ in attention.named_children()} != _ATTENTION_CHILDREN:
                    return False  # e.g. Qwen3's per-head norms
                linears = [getattr(attention, name) for name in sorted(_ATTENTION_CHILDREN)]
                linears += [getattr(mlp, name) for name in _MLP_LINEARS]
                if any(type(linear) is not torch.nn.Linear for linear in linears):
                    return False  # e.g. LoRA or quantized layers
                bypassed += [layer, attention, mlp, *linears]
        except AttributeError:
            return False
        if type(head) is not torch.nn.Linear or len(inner.layers) != len(cache.layers):
            return False
        return not any(
            m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in bypassed
        )

    def __init__(self, model: Any, cache: DynamicCache, batch: int, *, pack: bool) -> None:
        def linear(module: torch.nn.Linear) -> PackedLinear:
            return PackedLinear(module, batch if pack else None)

        self._model = model
        self._cache = cache
        self._layers = [
            _LlamaLayer(
                input_norm=layer.input_layernorm,
                q=linear(layer.self_attn.q_proj),
                k=linear(layer.self_attn.k_proj),
                v=linear(layer.self_attn.v_proj),
                o=linear(layer.self_attn.o_proj),
                post_norm=layer.post_attention_layernorm,
                gate=linear(layer.mlp.gate_proj),
                up=linear(layer.mlp.up_proj),
                down=linear(layer.mlp.down_proj),
                act=layer.mlp.act_fn,
                heads=model.config.num_attention_heads,
                kv_heads=model.config.num_key_value_heads,
                head_dim=layer.self_attn.head_dim,
                scaling=layer.self_attn.scaling,
            )
            for layer in model.model.layers
        ]
        self._head = linear(model.lm_head)

    def __call__(
        self, token_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """Next-token logits, float32 [B, V], after token_ids [B] at position_ids [B, 1];
        attention_mask [B, seen] covers the cache and the new token."""
        inner = self._model.model
        hidden = inner.embed_tokens(token_ids)  # [B, hidden]
        cos, sin = inner.rotary_emb(hidden, position_ids)  # [B, 1, head_dim], broadcast over heads
        # One query per row: its mask is the same for all heads and queries, [B, 1, 1, seen].
        mask = attention_mask.bool()[:, None, None, :]
        for layer, cache in zip(self._layers, self._cache.layers, strict=True):
            hidden = layer(hidden, cos, sin, mask, cache)
        return self._head(inner.norm(hidden)).float()


@dataclass(eq=False)
class _LlamaLayer:
    """One decoder layer's modules, and what its decode step computes with them."""

    input_norm: torch.nn.Module
    q: PackedLinear
    k: PackedLinear
    v: PackedLinear
    o: PackedLinear
    post_norm: torch.nn.Module
    gate: PackedLinear
    up: PackedLinear
    down: PackedLinear
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
        mask: torch.Tensor,
        cache: _PreallocatedLayer,
    ) -> torch.Tensor:
        batch = hidden.shape[0]
        x = self.input_norm(hidden)
        q = _rotate(self.q(x).view(batch, self.heads, self.head_dim), cos, sin)
        k = _rotate(self.k(x).view(batch, self.kv_heads, self.head_dim), cos, sin)
        v = self.v(x).view(batch, self.kv_heads, self.head_dim)
        keys, values = cache.update(k[:, :, None], v[:, :, None])  # [B, kv_heads, seen, head_dim]
        # Grouped-query attention without repeating the keys: the query heads that share a key
        # head (heads kv * group ... kv * group + group - 1) become that head's query rows.
        grouped = q.view(batch, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        attention = torch.nn.functional.scaled_dot_product_attention(
            grouped, keys, values, attn_mask=mask, scale=self.scaling
        )
        hidden = hidden + self.o(attention.reshape(batch, self.heads * self.head_dim))
        x = self.post_norm(hidden)
        return hidden + self.down(self.act(self.gate(x)) * self.up(x))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers' Llama applies it: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class PackedLinear:
    """nn.Linear's forward on the module's current weight, optionally through MKL's packed GEMM
    for a fixed number of rows (other row counts take the plain path).

    The packed copy is a snapshot: it lives for one chunk, during which the weights cannot change.
    """

    def __init__(self, module: torch.nn.Linear, rows: int | None) -> None:
        self.weight, self.bias, self.rows = module.weight, module.bias, rows
        self.packed = (
            None if rows is None else torch.ops.mkl._mkl_reorder_linear_weight(self.weight, rows)
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.shape[0] != self.rows:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, self.rows)


def should_pack(model: torch.nn.Module, max_new_tokens: int) -> bool:
    """Whether LlamaDecoder should pack the weights for MKL's packed GEMM: float32 on the CPU
    with torch built with MKL, a long enough generation to pay back the packing, and a packed
    copy (as large as the weights, for the length of the chunk) of at most PACK_MAX_BYTES."""
    weights = [p for p in model.parameters() if p.dim() == 2]
    return (
        max_new_tokens >= PACK_MIN_NEW_TOKENS
        and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in weights)
        and sum(p.numel() * p.element_size() for p in weights) <= PACK_MAX_BYTES
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


@contextmanager
def _eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Eval mode for the duration, then the module's previous mode back.

    The engine may share the learner's module, which is in train mode between steps; in train mode
    dropout would perturb the samples and gradient checkpointing would turn the KV cache off.
    """
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)
