"""DecodeBatch: continuous batching of generation rows in one preallocated KV cache.

A DecodeBatch samples up to `width` sequences (its slots) together. Each round it feeds every live
row the token it sampled last (one decode step for the whole batch), prefills the prompts waiting
for a free slot and writes their keys and values into those slots (one forward per distinct
prompt: the n samples of a prompt share it), then samples the next token of every row in one
pass, each row with its own sampling parameters. A finished row frees its slot and a waiting row
takes it in the next round, so no row waits for the longest of a static batch.

The cache layout: all rows share one write column t. A row's tokens lie right-aligned before t
(prompts are left-padded), so a decode step writes column t of every row. A prompt of P tokens
joining at column t takes columns t-P .. t-1 of its slot, with the slot's earlier columns masked.
When t < P, or the cache cannot hold every live row up to its max_new_tokens, the used columns
are copied into new buffers (with headroom, so that this stays rare).

A batch keeps its width while rows finish (a finished slot is fed padding until it is refilled).
An adaptive batch rounds its width up to a power of two; with MKL it packs from PACK_MIN_WIDTH
rows and keeps the packed weights of its two latest widths.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from rollout.engines.base import EngineStats, FinishReason, SamplingParams
from rollout.engines.hf.kv_cache import PreallocatedLayer, preallocated_cache
from rollout.engines.hf.llama_decoder import LlamaDecoder
from rollout.engines.hf.packing import packed_width
from rollout.engines.hf.prompts import distinct_prompts, left_pad, shared_prefix_length
from rollout.engines.sampling import sample_rows, sample_tokens

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
    stream: int = 0
    """The row's random stream in a static batch (StaticDecodeBatch), which draws its numbers
    from counter_uniform(stream, token index) instead of `generator`."""


class BatchEngine(Protocol):
    """What a DecodeBatch uses of the engine it samples for (HfEngine, which imports this module,
    so the batch names it by this Protocol): its model, padding token, device and statistics, the
    decode step and forward it runs, and how a sampled token is recorded."""

    _pad: int
    _device: torch.device
    _stats: EngineStats
    _weights_loaded: int

    @property
    def model(self) -> Any: ...

    def _decoder(self, cache: DynamicCache, width: int, pack: bool) -> Decoder: ...

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
    ) -> torch.Tensor: ...

    def _record(
        self,
        row: GenerationRow,
        token_id: int,
        logprob: float,
        top: list[tuple[int, float]] | None = None,
    ) -> None: ...


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
        self, engine: BatchEngine, *, width: int | None, pack: bool, max_width: int = 1
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
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=engine._device)
        """[width, capacity]: which cache columns each row attends to."""
        self._positions = torch.zeros(0, dtype=torch.long, device=engine._device)
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
        self._queue = drop_cancelled(self._queue, self._slots)
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
        distinct, which = distinct_prompts([row.prompt for row in rows])
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
        self._refillable = all(type(layer) is PreallocatedLayer for layer in cache.layers)
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
        distinct, which = distinct_prompts([row.prompt for row in rows])
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
        prefix_positions = torch.arange(shared, device=prefix.device)[None]
        decoder.forward(prefix, prefix_positions, torch.ones_like(prefix), prefix_cache)
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


def drop_cancelled(
    queue: deque[GenerationRow], slots: list[GenerationRow | None]
) -> deque[GenerationRow]:
    """The queue without its cancelled rows; cancelled rows in `slots` are freed in place.
    Shared by DecodeBatch and the static path's StaticDecodeBatch."""
    for slot, row in enumerate(slots):
        if row is not None and row.cancelled:
            slots[slot] = None
    if any(row.cancelled for row in queue):
        return deque(row for row in queue if not row.cancelled)
    return queue


def _bucket(rows: int, most: int) -> int:
    """The width for `rows` rows: the next power of two, at most `most`."""
    return min(1 << max(rows - 1, 0).bit_length(), most)


def _prompt_batch(
    prompts: list[list[int]], engine: BatchEngine
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
