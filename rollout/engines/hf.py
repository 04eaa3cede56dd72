"""The embedded engine: continuous batching with a KV cache on a transformers causal LM.

A DecodeBatch samples up to `width` sequences (its slots) together in one preallocated KV cache.
Each round it feeds every live row the token it sampled last (one decode step for the whole
batch), prefills the prompts waiting for a free slot and writes their keys and values into those
slots (one forward per distinct prompt: the n samples of a prompt share it), then samples the
next token of every row in one pass, each row with its own sampling parameters. A finished row
frees its slot and a waiting row takes it in the next round, so no row waits for the longest of
a static batch.

`HfEngine.generate()`, the batch API the trainer uses, queues its rows in a DecodeBatch of fixed
width (max_batch_size, or all rows) and steps it until it drains: when every row fits, that is
one static batch, exactly what it was before continuous batching. EngineService
(rollout.engines.service) steps one DecodeBatch of adaptive width in a background thread, so
requests of concurrent clients join the running batch.

The cache layout: all rows share one write column t. A row's tokens lie right-aligned before t
(prompts are left-padded), so a decode step writes column t of every row. A prompt of P tokens
joining at column t takes columns t-P .. t-1 of its slot, with the slot's earlier columns masked.
When t < P, or the cache cannot hold every live row up to its max_new_tokens, the used columns
are copied into new buffers (with headroom, so that this stays rare).

Speed on CPU: the KV cache is preallocated, sampling draws one uniform number per row
(sample_tokens), and Llama-family models (llama, mistral, qwen2) prefill and decode through
LlamaDecoder, a forward written out in plain torch on packed weights (oneDNN's, which serve any
batch width; else MKL's, packed per batch width); other models run their own forward. Prompts that
begin alike (a system prompt, a chat template) prefill that shared prefix once. A batch keeps its
width while rows finish (a finished slot is fed padding until it is refilled). An adaptive batch
rounds its width up to a power of two; with MKL it packs from PACK_MIN_WIDTH rows and keeps the
packed weights of its two latest widths.

What a Completion carries, precisely (the learner depends on it):
- token_ids are the sampled tokens; an eos token that ended the completion is included (so the
  policy learns to stop), a stop string and the tokens that make it are not.
- logprobs[i] is log_softmax(logits / T)[token_ids[i]] in float32, T the temperature (T=1 when
  greedy), computed BEFORE top-k/top-p truncation: the learner recomputes exactly this from one
  forward over prompt + completion.
- text is the decoded completion without special tokens, cut before the first stop string.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rollout.engines.base import (
    Completion,
    EngineStats,
    FinishReason,
    SamplingParams,
    cache_keyword,
    cut_at_stop,
)
from rollout.engines.sampling import sample_rows, sample_tokens

# A character is at most 4 UTF-8 bytes and every token carries at least one byte, so a stop string
# of c characters lies within its last 4c tokens; one more covers a character split across tokens.
_BYTES_PER_CHAR = 4

Decoder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache], torch.Tensor]
"""A decode step: (token ids [B], position ids [B, 1], attention mask [B, seen], the cache) ->
next-token logits [B, V], writing the tokens' keys and values into the cache."""

Listener = Callable[["GenerationRow", int, float], None]


@dataclass(eq=False)
class GenerationRow:
    """One completion while it is being sampled."""

    prompt_index: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    """Draws this row's random numbers; rows of one seeded request share their own."""
    listener: Listener | None = None
    """Called by the thread stepping the batch with each (row, token id, log-prob) sampled,
    once the token is recorded (its alternatives are then top_logprobs[-1])."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Each token's params.top_logprobs most likely (token id, log-prob); empty when not asked."""
    finish_reason: FinishReason | None = None
    cancelled: bool = False
    """Set from any thread: the batch drops the row at its next step, without a completion."""
    first_column: int = 0
    """The cache column of the row's first prompt token (its slot is masked before it)."""


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
        keep_packed: bool = False,
    ) -> None:
        """`model` is used in place (it may be the learner's own module). `seed` seeds the
        engine's generator, used when SamplingParams.seed is None; None draws a random seed.

        `keep_packed` keeps the packed weights of generate()'s last batch width from one call to
        the next until load_weights: for serving and batch inference, where the weights do not
        change, packing (about 0.65 s for SmolLM2) is paid once. Off for training, where the
        weights change after every call and the copy would sit beside the learner's memory."""
        if not eos_token_ids:
            raise ValueError("eos_token_ids is empty: the engine needs a token that ends a turn")
        self._model = model
        self._cache_keyword = cache_keyword(model)
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
        self._keep_packed = keep_packed
        self._kept: tuple[tuple[int, int | None], Decoder] | None = None
        """(weights generation, packed_width) -> the decoder whose packed weights are kept."""
        self._weights_loaded = 0
        """Counts load_weights calls: a DecodeBatch drops its packed weights when it moves."""
        self._stats = EngineStats()

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def model(self) -> Any:
        return self._model

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_batch_size(self) -> int | None:
        return self._max_batch_size

    @property
    def context_length(self) -> int | None:
        """The most positions (prompt + completion) the model takes, if its config says."""
        return getattr(self._model.config, "max_position_embeddings", None)

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
            GenerationRow(index, list(prompt), params, generator)
            for index, prompt in enumerate(prompts)
            for _ in range(params.n)
        ]
        if not rows:
            return []
        width = min(self._max_batch_size or len(rows), len(rows))
        batch = DecodeBatch(self, width=width, pack=should_pack(self._model, params.max_new_tokens))
        batch.add(rows)
        with eval_mode(self._model), torch.inference_mode():
            while batch.busy:
                batch.step()
        return [self.completion(row) for row in rows]

    def generate_one(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[Completion]:
        """The `params.n` completions of one prompt."""
        return self.generate([prompt_ids], params)

    def load_weights(self, weights: Mapping[str, torch.Tensor] | None, version: int) -> None:
        """New weights from the learner; None when the module is shared and already up to date."""
        if weights is not None:
            self._model.load_state_dict(dict(weights), strict=True)
        self._version = version
        self._weights_loaded += 1

    def close(self) -> None:
        """Nothing to release: the model belongs to the caller."""

    # --- the pieces a scheduler drives (EngineService) ---------------------------------------------

    def rows(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt_index: int = 0,
        listener: Listener | None = None,
    ) -> list[GenerationRow]:
        """The `params.n` rows of one prompt, ready for DecodeBatch.add. A seeded request gets a
        generator of its own; an unseeded one draws from the engine's."""
        if not prompt_ids:
            raise ValueError("a prompt has no tokens: every prompt needs at least one")
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(self._device).manual_seed(params.seed)
        return [
            GenerationRow(prompt_index, list(prompt_ids), params, generator, listener)
            for _ in range(params.n)
        ]

    def decode_batch(self, max_width: int) -> DecodeBatch:
        """A batch of adaptive width, at most `max_width` rows, keeping its packed weights
        between steps (until load_weights): for a long-lived scheduler."""
        pack = should_pack(self._model, PACK_MIN_NEW_TOKENS)
        return DecodeBatch(self, width=None, max_width=max_width, pack=pack)

    def completion(self, row: GenerationRow) -> Completion:
        """The finished row as the Completion that callers and the learner see."""
        assert row.finish_reason is not None
        token_ids, logprobs, top = row.token_ids, row.logprobs, row.top_logprobs
        if row.finish_reason == "stop":
            keep, text = cut_at_stop(token_ids, row.params.stop, self._decode)
            token_ids, logprobs, top = token_ids[:keep], logprobs[:keep], top[:keep]
        else:
            text = self._decode(token_ids)
        return Completion(
            prompt_index=row.prompt_index,
            token_ids=list(token_ids),
            logprobs=list(logprobs),
            text=text,
            finish_reason=row.finish_reason,
            policy_version=self._version,
            top_logprobs=list(top) if row.params.top_logprobs else None,
        )

    # --- what a DecodeBatch calls ------------------------------------------------------------------

    def _decoder(self, cache: DynamicCache, width: int, pack: bool) -> Decoder:
        """The decode step for a batch of `width` rows. A Llama-family model gets its step
        written out here (LlamaDecoder); any other model runs its own forward."""
        if LlamaDecoder.supports(self._model, cache):
            kernel = packing_kernel() if pack else None
            if kernel is None or not self._keep_packed:
                return LlamaDecoder(self._model, width, kernel=kernel)
            key = (self._weights_loaded, packed_width(width))
            if self._kept is None or self._kept[0] != key:
                self._kept = None  # the old packed copy goes before the new one is made
                self._kept = (key, LlamaDecoder(self._model, width, kernel=kernel))
            return self._kept[1]

        def step(
            token_ids: torch.Tensor,
            position_ids: torch.Tensor,
            mask: torch.Tensor,
            cache: DynamicCache,
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
            **{self._cache_keyword: cache},
            use_cache=True,
            logits_to_keep=1,  # the prefill needs only the last position's [B, V], not [B, S, V]
        )
        return output.logits[:, -1].float()

    def _record(
        self,
        row: GenerationRow,
        token_id: int,
        logprob: float,
        top: list[tuple[int, float]] | None = None,
    ) -> None:
        """Append one sampled token (and the batch's most likely tokens for its row, of which it
        keeps as many as it asked for) to the row and note whether it finished the row."""
        row.token_ids.append(token_id)
        row.logprobs.append(logprob)
        if row.params.top_logprobs and top is not None:
            row.top_logprobs.append(top[: row.params.top_logprobs])
        if token_id in self._eos:
            row.finish_reason = "eos"
        elif row.params.stop and self._ends_with_stop(row.token_ids, row.params.stop):
            row.finish_reason = "stop"
        elif len(row.token_ids) >= row.params.max_new_tokens:
            row.finish_reason = "length"

    def _ends_with_stop(self, token_ids: list[int], stop: tuple[str, ...]) -> bool:
        """Whether the newest token completed a stop string. Earlier tokens were checked at their
        own step, so only the last few tokens' text needs decoding."""
        window = _BYTES_PER_CHAR * max(len(s) for s in stop) + 1
        tail = self._decode(token_ids[-window:])
        return any(s in tail for s in stop)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


MAX_PACKED_WIDTHS = 2
"""Packed weight copies an adaptive batch keeps (each as large as the model's 2-D weights)."""

PACK_MIN_WIDTH = 4
"""Narrowest adaptive batch whose weights are packed: at 1 and 2 rows the plain GEMM was as fast
(SmolLM2, 2 threads: 75 against 100 ms a step at 1 row, 83 against 90 at 2; packed wins from 4
rows, 100 against 122, and 116 against 155 at 8)."""

HEADROOM = 1.5
"""Cache columns allocated when the layout moves, per column needed: fewer moves later."""


class DecodeBatch:
    """Rows sampled together in one KV cache and refilled as they finish (continuous batching).

    Not thread-safe: one thread adds rows and steps it (generate(), or EngineService's loop),
    under torch.inference_mode with the model in eval mode.
    """

    def __init__(
        self, engine: HfEngine, *, width: int | None, pack: bool, max_width: int = 1
    ) -> None:
        """`width` fixes the number of rows fed at each step (finished rows are fed padding);
        None adapts it to demand: a power of two up to `max_width`."""
        self._engine = engine
        self._fixed_width = width
        self._max_width = width or max_width
        self._pack = pack
        self._queue: deque[GenerationRow] = deque()
        self._slots: list[GenerationRow | None] = []
        self._cache: DynamicCache | None = None
        self._refillable = False
        self._decoders: dict[int | None, Decoder] = {}
        """packed_width -> the decoder for it."""
        self._weights_loaded = engine._weights_loaded
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        """[width, capacity]: which cache columns each row attends to."""
        self._positions = torch.zeros(0, dtype=torch.long)
        """[width]: the position id of each row's next token."""
        self._logits: torch.Tensor | None = None
        """[width, V]: next-token logits, to sample from."""
        self._sampled: torch.Tensor | None = None
        """[width]: the tokens sampled last, to feed at the next decode step."""
        self._column = 0
        self._capacity = 0

    @property
    def busy(self) -> bool:
        """Whether rows are waiting or being sampled."""
        return bool(self._queue) or any(row is not None for row in self._slots)

    @property
    def width(self) -> int:
        return len(self._slots)

    def live_rows(self) -> list[GenerationRow]:
        return [row for row in self._slots if row is not None]

    def add(self, rows: Sequence[GenerationRow]) -> None:
        """Queue rows; they take free slots at the next steps, in order."""
        self._queue.extend(rows)

    def step(self) -> list[GenerationRow]:
        """One round: a decode step for the live rows, prefill of waiting rows into free slots,
        one token sampled for every row. Returns the rows that finished in it; cancelled rows
        are dropped without finishing."""
        started = time.perf_counter()
        self._drop_cancelled()
        if self._engine._weights_loaded != self._weights_loaded:
            self._decoders.clear()  # the packed copies hold the old weights
            self._weights_loaded = self._engine._weights_loaded
        if any(row is not None for row in self._slots):
            self._decode()
        self._admit()
        finished = self._sample() if any(row is not None for row in self._slots) else []
        self._shrink()
        stats = self._engine._stats
        stats.seconds += time.perf_counter() - started
        return finished

    def reset(self) -> None:
        """Forget every row and the cache (after a failed step)."""
        self._queue.clear()
        self._slots = []
        self._cache = self._logits = self._sampled = None

    # --- a step's parts ----------------------------------------------------------------------------

    def _drop_cancelled(self) -> None:
        if any(row.cancelled for row in self._queue):
            self._queue = deque(row for row in self._queue if not row.cancelled)
        for slot, row in enumerate(self._slots):
            if row is not None and row.cancelled:
                self._slots[slot] = None

    def _decode(self) -> None:
        """Feed every row its last sampled token (padding for empty slots) at column t."""
        assert self._cache is not None and self._sampled is not None
        column = self._column
        self._mask[:, column] = 1
        empty = torch.tensor([row is None for row in self._slots], device=self._mask.device)
        feed = self._sampled.masked_fill(empty, self._engine._pad)
        self._logits = self._decoder(self.width, self._cache)(
            feed, self._positions[:, None], self._mask[:, : column + 1], self._cache
        )
        self._positions += 1
        self._column = column + 1
        self._engine._stats.extra["decode_steps"] = (
            self._engine._stats.extra.get("decode_steps", 0) + 1
        )

    def _admit(self) -> None:
        """Give waiting rows the free slots: a fresh cache when no row is live, else (where every
        layer's cache is preallocated) a prefill written into the free slots."""
        if not self._queue:
            return
        if not any(row is not None for row in self._slots):
            self._start()
        elif self._refillable:
            free = self._free_slots()
            wanted = self.width - len(free) + len(self._queue)
            if self._fixed_width is None and wanted > self.width and self.width < self._max_width:
                self._resize(_bucket(wanted, self._max_width))
                free = self._free_slots()
            if free:
                self._refill(self._take(len(free)), free)
        else:
            return
        live = sum(row is not None for row in self._slots)
        extra = self._engine._stats.extra
        extra["max_live_rows"] = max(extra.get("max_live_rows", 0), live)

    def _start(self) -> None:
        """Prefill waiting rows into a new cache sized for them."""
        width = self._fixed_width or _bucket(len(self._queue), self._max_width)
        rows = self._take(width)
        distinct, which = _distinct([row.prompt for row in rows])
        input_ids, prompt_mask, positions = _prompt_batch(distinct, self._engine)
        prompt_width = input_ids.shape[1]
        capacity = prompt_width + max(row.params.max_new_tokens for row in rows)
        cache = preallocated_cache(self._engine.model.config, capacity)
        logits = self._prefill(distinct, input_ids, prompt_mask, positions, cache, width)
        # Each distinct prompt was prefilled once; its cache and logits are copied to its rows.
        # Slots beyond the rows (an adaptive width rounds up) copy row 0 and stay empty.
        if len(distinct) < width:
            index = torch.tensor(which + [which[0]] * (width - len(rows)), device=logits.device)
            cache.batch_select_indices(index)
            logits, prompt_mask, positions = logits[index], prompt_mask[index], positions[index]
        self._cache = cache
        self._refillable = all(type(layer) is _PreallocatedLayer for layer in cache.layers)
        self._mask = torch.cat(
            [prompt_mask, prompt_mask.new_zeros(width, capacity - prompt_width)], 1
        )
        self._positions = positions[:, -1] + 1
        self._logits, self._sampled = logits, None
        self._column, self._capacity = prompt_width, capacity
        self._slots = [*rows, *[None] * (width - len(rows))]
        for row in rows:
            row.first_column = prompt_width - len(row.prompt)
        self._engine._stats.prompt_tokens += sum(len(row.prompt) for row in rows)

    def _refill(self, rows: list[GenerationRow], slots: list[int]) -> None:
        """Prefill `rows` and write their keys, values, mask and logits into free `slots`."""
        assert self._cache is not None and self._logits is not None
        distinct, which = _distinct([row.prompt for row in rows])
        input_ids, prompt_mask, positions = _prompt_batch(distinct, self._engine)
        prompt_width = input_ids.shape[1]
        self._make_room(prompt_width, max(row.params.max_new_tokens for row in rows) - 1)
        prefilled = preallocated_cache(self._engine.model.config, prompt_width)
        logits = self._prefill(distinct, input_ids, prompt_mask, positions, prefilled, self.width)
        device = logits.device
        index = torch.tensor(which, device=device)
        targets = torch.tensor(slots[: len(rows)], device=device)
        end = self._column
        for layer, source in zip(self._cache.layers, prefilled.layers, strict=True):
            layer.write(targets, source.keys[index], source.values[index], end)
        self._mask[targets] = 0
        self._mask[targets, end - prompt_width : end] = prompt_mask[index]
        self._positions[targets] = positions[index, -1] + 1
        self._logits[targets] = logits[index]
        for slot, row in zip(slots, rows, strict=False):
            self._slots[slot] = row
            row.first_column = end - len(row.prompt)
        self._engine._stats.prompt_tokens += sum(len(row.prompt) for row in rows)

    def _sample(self) -> list[GenerationRow]:
        """One token for every row, in one pass; returns the rows it finished."""
        assert self._logits is not None
        live = [row for row in self._slots if row is not None]
        first = live[0]
        if all(row.params is first.params and row.generator is first.generator for row in live):
            # generate(): one set of parameters, one stream of random numbers for the batch.
            token_ids, logprobs, top = sample_tokens(self._logits, first.params, first.generator)
        else:
            token_ids, logprobs, top = self._sample_per_row()
        self._sampled = token_ids
        finished = []
        record = self._engine._record
        # Alternatives are computed only when some row asked for them (top is None otherwise).
        tops = (
            [
                list(zip(ids, values, strict=True))
                for ids, values in zip(top.token_ids.tolist(), top.logprobs.tolist(), strict=True)
            ]
            if top is not None
            else [None] * len(self._slots)
        )
        for slot, (row, token_id, logprob, alternatives) in enumerate(
            zip(self._slots, token_ids.tolist(), logprobs.tolist(), tops, strict=True)
        ):
            if row is None:
                continue
            record(row, token_id, logprob, alternatives)
            if row.listener is not None:
                row.listener(row, token_id, logprob)
            if row.finish_reason is not None:
                self._slots[slot] = None
                finished.append(row)
        self._engine._stats.generated_tokens += len(live)
        return finished

    def _sample_per_row(self) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """sample_rows with each row's parameters and its own generator's draw; alternatives
        when some row asks for them, as many as the most any row asks for."""
        assert self._logits is not None
        device = self._logits.device
        rows = self._slots
        temperature = torch.tensor(
            [row.params.temperature if row else 0.0 for row in rows], device=device
        )
        top_k = torch.tensor([row.params.top_k if row else 0 for row in rows], device=device)
        top_p = torch.tensor([row.params.top_p if row else 1.0 for row in rows], device=device)
        uniform = torch.zeros(len(rows), device=device)
        groups: dict[int, tuple[torch.Generator, list[int]]] = {}
        for slot, row in enumerate(rows):
            if row is not None and row.params.temperature > 0:
                groups.setdefault(id(row.generator), (row.generator, []))[1].append(slot)
        for generator, slots in groups.values():
            uniform[slots] = torch.rand(len(slots), generator=generator, device=device)
        top = max((row.params.top_logprobs for row in rows if row is not None), default=0)
        return sample_rows(self._logits, temperature, top_k, top_p, uniform, top=top)

    def _shrink(self) -> None:
        """An adaptive batch with no rows waiting drops to a quarter of its width or less."""
        live = sum(row is not None for row in self._slots)
        if self._fixed_width is None and not self._queue and 0 < live <= self.width // 4:
            self._resize(_bucket(live, self._max_width))

    # --- the layout --------------------------------------------------------------------------------

    def _decoder(self, width: int, cache: DynamicCache) -> Decoder:
        """The decode step for `width` rows (built once per packed_width) on caches like
        `cache`."""
        key = packed_width(width)
        decoder = self._decoders.get(key)
        if decoder is None:
            if len(self._decoders) >= MAX_PACKED_WIDTHS:
                del self._decoders[next(iter(self._decoders))]
            started = time.perf_counter()
            # MKL's packing pays only from PACK_MIN_WIDTH rows in an adaptive batch; generate()
            # packs as it always did, so that its outputs stay what they were. oneDNN's packed
            # copy serves every width.
            pack = self._pack and (
                key is None or self._fixed_width is not None or width >= PACK_MIN_WIDTH
            )
            decoder = self._engine._decoder(cache, width, pack)
            self._decoders[key] = decoder
            extra = self._engine._stats.extra
            extra["decoders_built"] = extra.get("decoders_built", 0) + 1
            extra["decoder_build_s"] = extra.get("decoder_build_s", 0.0) + (
                time.perf_counter() - started
            )
        return decoder

    def _prefill(
        self,
        prompts: list[list[int]],
        input_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache,
        width: int,
    ) -> torch.Tensor:
        """Last-position logits [B, V] of `prompts` (left-padded: input_ids, prompt_mask,
        positions [B, P]) prefilled into the empty `cache`, for a batch `width` rows wide.

        Through the batch's written-out step where there is one (its packed weights are faster
        here too), else the model's own forward. Prompts that begin alike (a system prompt, a
        chat template) share that prefix: its keys and values are computed once and copied into
        every row, and only the columns after it are run for the whole batch."""
        decoder = self._decoder(width, cache)
        if not isinstance(decoder, LlamaDecoder):
            return self._engine._forward(input_ids, prompt_mask, positions, cache)
        shared = shared_prefix_length(prompts)
        if shared < SHARED_PREFIX_MIN_TOKENS:
            return decoder.forward(input_ids, positions, prompt_mask, cache)
        prefix_cache = preallocated_cache(self._engine.model.config, shared)
        prefix = torch.tensor([prompts[0][:shared]], device=input_ids.device)
        decoder.forward(prefix, torch.arange(shared)[None], torch.ones_like(prefix), prefix_cache)
        # Row i's prompt takes columns P - len_i .. P - 1, its prefix the first `shared` of them.
        # Columns from `tail` on are run for every row: the longest prompt's part after the
        # prefix, and in shorter rows some prefix tokens again (same keys and values) or padding.
        prompt_width = input_ids.shape[1]
        firsts = [prompt_width - len(prompt) for prompt in prompts]
        tail = prompt_width - max(len(prompt) for prompt in prompts) + shared
        for layer, source in zip(cache.layers, prefix_cache.layers, strict=True):
            layer.place_prefix(source.keys, source.values, firsts, tail)
        return decoder.forward(input_ids[:, tail:], positions[:, tail:], prompt_mask, cache)

    def _free_slots(self) -> list[int]:
        return [slot for slot, row in enumerate(self._slots) if row is None]

    def _take(self, count: int) -> list[GenerationRow]:
        return [self._queue.popleft() for _ in range(min(count, len(self._queue)))]

    def _make_room(self, prompt_width: int, new_feeds: int) -> None:
        """Ensure the cache has `prompt_width` columns before t for a refill, and room after t
        for every live row's remaining tokens (`new_feeds` for the newcomers)."""
        live = [row for row in self._slots if row is not None]
        feeds = max(
            [new_feeds, *(row.params.max_new_tokens - len(row.token_ids) - 1 for row in live)]
        )
        column = self._column
        if column >= prompt_width and column + feeds <= self._capacity:
            return
        first = min(row.first_column for row in live)
        new_column = max(column - first, prompt_width)
        capacity = max(self._capacity, int((new_column + feeds) * HEADROOM))
        self._relayout(None, first, new_column - column, capacity)

    def _resize(self, width: int) -> None:
        """Move the live rows to the first slots of a batch `width` wide."""
        live = [slot for slot, row in enumerate(self._slots) if row is not None]
        order = live + [live[0]] * (width - len(live))
        index = torch.tensor(order, device=self._mask.device)
        first = min(row.first_column for row in self._slots if row is not None)
        self._relayout(index, first, 0, self._capacity)
        self._slots = [self._slots[slot] for slot in live] + [None] * (width - len(live))
        self._positions = self._positions[index]
        if self._logits is not None:
            self._logits = self._logits[index]
        if self._sampled is not None:
            self._sampled = self._sampled[index]

    def _relayout(self, rows: torch.Tensor | None, first: int, shift: int, capacity: int) -> None:
        """New buffers of `capacity` columns holding rows `rows` (all when None) of the cache
        columns first .. t-1, moved by `shift` columns."""
        assert self._cache is not None
        for layer in self._cache.layers:
            layer.relayout(rows, first, shift, capacity)
        column = self._column
        mask = self._mask[:, first:column] if rows is None else self._mask[rows, first:column]
        self._mask = mask.new_zeros(mask.shape[0], capacity)
        self._mask[:, first + shift : column + shift] = mask
        self._column, self._capacity = column + shift, capacity
        for row in self._slots:
            if row is not None:
                row.first_column += shift
        extra = self._engine._stats.extra
        extra["relayouts"] = extra.get("relayouts", 0) + 1


def _bucket(rows: int, most: int) -> int:
    """The width for `rows` rows: the next power of two, at most `most`."""
    return min(1 << max(rows - 1, 0).bit_length(), most)


def _prompt_batch(
    prompts: list[list[int]], engine: HfEngine
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts: (input ids [B, P], attention mask [B, P], position ids [B, P])."""
    input_ids, prompt_mask = left_pad(prompts, engine._pad, engine._device)
    # Left padding shifts each prompt right; positions count real tokens only, so every row
    # sees the positions it would see alone (and that the learner's right-padded forward uses).
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, prompt_mask, positions


SHARED_PREFIX_MIN_TOKENS = 4
"""Shortest common prompt prefix worth computing once: below it, the extra one-row forward and
the copies cost about what they save."""


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


# --- a written-out decode step for Llama-family models ------------------------------------------

PACK_MIN_NEW_TOKENS = 16
"""Shortest generation worth packing the weights for: packing costs about as much time as ten
decode steps of SmolLM2 at batch 8 save with it (it mostly pays for fresh memory pages)."""

PACK_MAX_BYTES = 2 * 1024**3
"""Largest model (its 2-D weights, in bytes) to pack: the packed copy lives beside the weights
while a batch is sampled, memory that the plan's estimate does not count."""

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
        if not all(type(layer) is _PreallocatedLayer for layer in cache.layers):
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
                if any(type(linear) is not torch.nn.Linear for linear in linears):
                    return False  # e.g. LoRA or quantized layers
                norms += [layer.input_layernorm, layer.post_attention_layernorm]
                bypassed += [layer, attention, mlp, *linears, *norms[-2:]]
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
        cache: _PreallocatedLayer,
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
    memory for long); otherwise each layer is its own PackedLinear and the outputs are joined."""

    def __init__(self, modules: Sequence[torch.nn.Linear], kernel: str | None, rows: int) -> None:
        if kernel == "onednn" and len(modules) > 1:
            weight = torch.cat([m.weight for m in modules])
            bias = None
            if any(m.bias is not None for m in modules):
                bias = torch.cat(
                    [
                        m.weight.new_zeros(m.out_features) if m.bias is None else m.bias
                        for m in modules
                    ]
                )
            self._linears = [PackedLinear(weight, bias, kernel, rows)]
        else:
            self._linears = [PackedLinear(m.weight, m.bias, kernel, rows) for m in modules]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self._linears) == 1:
            return self._linears[0](x)
        return torch.cat([linear(x) for linear in self._linears], dim=-1)


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


@contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
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
