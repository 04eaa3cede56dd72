"""StaticDecodeBatch: continuous batching over a StaticDecoder, the host looking every few steps.

The same interface as DecodeBatch (add, step, busy, reset), for EngineService and generate().
One `step()` is one host round:

1. drop cancelled rows; give waiting rows the free slots (their prompts prefilled into them);
2. run up to RING_STEPS decode steps on the device (CUDA graph replays), never more than the
   fewest tokens any live row still may sample, so that a row ending by length ends exactly there;
3. read the ring of sampled tokens and log-probs once (one host sync), record them into the rows
   (eos, stop strings, max_new_tokens end a row; what a row sampled after its end is dropped) and
   free the finished rows' slots;
4. with nothing waiting, move the live rows down into the narrowest width bucket that holds them.

The width of a step is the width bucket (a power of two, at most max_width) holding the highest
occupied slot; the span is the span bucket holding every live row's columns to the end of the
round. Each (width, span, sampling variant) is captured once and replayed after.

What is reproducible: a row draws its t-th token with counter_uniform(stream, t), its stream
fixed when it is made (HfEngine: from the request's seed and the row's index, or drawn from the
engine's generator when unseeded). Its tokens are then a function of its seed, its index and its
logits: the same whatever else shares the batch, whichever slot or bucket it has and however often
the host looks, with graphs or without. Logits themselves can differ in the last bits between
batch widths (the GEMMs split their work by shape), which can change a sampled token at a near
tie; on the CPU in float32 the tests see none.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

from rollout.engines.base import EngineStats
from rollout.engines.hf.decode_batch import GenerationRow, _bucket, drop_cancelled
from rollout.engines.hf.static_step import RING_STEPS, RowSetup, StaticDecoder, span_bucket


class StaticEngine(Protocol):
    """What a StaticDecodeBatch uses of its engine (HfEngine)."""

    _pad: int
    _stats: EngineStats

    def _static_decoder(self, width: int, capacity: int) -> StaticDecoder: ...

    def _record(
        self,
        row: GenerationRow,
        token_id: int,
        logprob: float,
        top: list[tuple[int, float]] | None = None,
    ) -> None: ...


class StaticDecodeBatch:
    """Rows sampled together in a StaticDecoder's slots, refilled as they finish (module
    docstring). Not thread-safe: one thread adds rows and steps it."""

    def __init__(self, engine: StaticEngine, *, max_width: int) -> None:
        self._engine = engine
        self._max_width = max_width
        self._queue: deque[GenerationRow] = deque()
        self._slots: list[GenerationRow | None] = [None] * max_width
        self._decoder: StaticDecoder | None = None

    @property
    def busy(self) -> bool:
        return bool(self._queue) or any(row is not None for row in self._slots)

    @property
    def width(self) -> int:
        """The width bucket the next decode step runs at."""
        return _bucket(self._highest() + 1, self._max_width) if self._highest() >= 0 else 0

    def live_rows(self) -> list[GenerationRow]:
        return [row for row in self._slots if row is not None]

    def add(self, rows: Sequence[GenerationRow]) -> None:
        self._queue.extend(rows)

    def reset(self) -> None:
        """Forget every row (after a failed step); the decoder's slots are simply reused, its
        ring read from the start again."""
        self._queue.clear()
        self._slots = [None] * self._max_width
        if self._decoder is not None:
            self._decoder.ring_at.zero_()

    def step(self) -> list[GenerationRow]:
        """One host round (module docstring); returns the rows that finished in it."""
        started = time.perf_counter()
        with torch.inference_mode():
            finished = self._round()
        self._engine._stats.seconds += time.perf_counter() - started
        return finished

    # --- a round ---------------------------------------------------------------------------

    def _round(self) -> list[GenerationRow]:
        self._queue = drop_cancelled(self._queue, self._slots)
        self._admit()
        live = [(slot, row) for slot, row in enumerate(self._slots) if row is not None]
        if not live:
            return []
        decoder = self._current_decoder(0)
        steps = min(
            RING_STEPS, *(row.params.max_new_tokens - len(row.token_ids) for _, row in live)
        )
        width = self.width
        reach = max(len(row.prompt) + len(row.token_ids) for _, row in live) + steps
        span = span_bucket(reach, decoder.capacity)
        vocabulary = decoder.logits.shape[-1]
        truncating = any(
            row.params.temperature > 0
            and (0 < row.params.top_k < vocabulary or row.params.top_p < 1.0)
            for _, row in live
        )
        alternatives = max(row.params.top_logprobs for _, row in live)
        if alternatives:
            decoder.ensure_alternatives(alternatives)
            alternatives = decoder.ring_top_ids.shape[-1]
        for _ in range(steps):
            decoder.decode(width, span, truncating=truncating, alternatives=alternatives)
        finished = self._collect(decoder, steps, width, alternatives > 0)
        self._compact(decoder)
        extra = self._engine._stats.extra
        extra["decode_steps"] = extra.get("decode_steps", 0) + steps
        extra["host_reads"] = extra.get("host_reads", 0) + 1
        captures, seconds = decoder.captures
        extra["graph_captures"], extra["graph_capture_s"] = captures, seconds
        return finished

    def _current_decoder(self, capacity: int) -> StaticDecoder:
        """The engine's decoder with room for this batch and `capacity` columns; its weights
        followed. A decoder the engine replaced while rows live would have lost them."""
        decoder = self._engine._static_decoder(self._max_width, capacity)
        if decoder is not self._decoder:
            if self._decoder is not None and any(row is not None for row in self._slots):
                raise RuntimeError(
                    "the model's dtype or device changed while rows were being sampled: their "
                    "cache is gone"
                )
            self._decoder = decoder
        return decoder

    def _admit(self) -> None:
        """Prefill waiting rows into the lowest free slots."""
        free = [slot for slot, row in enumerate(self._slots) if row is None]
        if not self._queue or not free:
            return
        rows = [self._queue.popleft() for _ in range(min(len(free), len(self._queue)))]
        live = [row for row in self._slots if row is not None]
        capacity = max(len(row.prompt) + row.params.max_new_tokens for row in [*rows, *live])
        decoder = self._current_decoder(capacity)
        setups = [
            RowSetup(
                row.prompt, row.stream, row.params.temperature, row.params.top_k, row.params.top_p
            )
            for row in rows
        ]
        targets = free[: len(rows)]
        decoder.prefill(targets, setups, self._engine._pad)
        for slot, row in zip(targets, rows, strict=True):
            self._slots[slot] = row
        stats = self._engine._stats
        stats.prompt_tokens += sum(len(row.prompt) for row in rows)
        stats.extra["max_live_rows"] = max(
            stats.extra.get("max_live_rows", 0), len(live) + len(rows)
        )

    def _collect(
        self, decoder: StaticDecoder, steps: int, width: int, alternatives: bool
    ) -> list[GenerationRow]:
        """Record the ring's `steps` tokens of every live row (one host read); returns the rows
        that finished, their slots freed."""
        # Token ids are exact in float32 (below 2^24), so one transfer carries both.
        both = torch.stack(
            (
                decoder.ring_tokens[:steps, :width].to(torch.float32),
                decoder.ring_logprobs[:steps, :width],
            )
        ).cpu()
        tokens, logprobs = both[0].long().tolist(), both[1].tolist()
        top_ids = top_logprobs = None
        if alternatives:
            top_ids = decoder.ring_top_ids[:steps, :width].tolist()
            top_logprobs = decoder.ring_top_logprobs[:steps, :width].tolist()
        decoder.ring_at.zero_()
        record, finished, recorded = self._engine._record, [], 0
        for slot in range(width):
            row = self._slots[slot]
            if row is None:
                continue
            for step in range(steps):
                token_id, logprob = tokens[step][slot], logprobs[step][slot]
                top = None
                if top_ids is not None and top_logprobs is not None:
                    top = list(zip(top_ids[step][slot], top_logprobs[step][slot], strict=True))
                record(row, token_id, logprob, top)
                recorded += 1
                if row.listener is not None:
                    row.listener(row, token_id, logprob)
                if row.finish_reason is not None:
                    self._slots[slot] = None
                    finished.append(row)
                    break
        self._engine._stats.generated_tokens += recorded
        return finished

    def _compact(self, decoder: StaticDecoder) -> None:
        """With no row waiting, move the live rows into the narrowest bucket that holds them."""
        live = [slot for slot, row in enumerate(self._slots) if row is not None]
        if self._queue or not live:
            return
        narrow = _bucket(len(live), self._max_width)
        if self.width <= narrow:
            return
        sources = [slot for slot in live if slot >= narrow]
        targets = [slot for slot in range(narrow) if self._slots[slot] is None][: len(sources)]
        decoder.move(sources, targets)
        for source, target in zip(sources, targets, strict=True):
            self._slots[target], self._slots[source] = self._slots[source], None
        extra = self._engine._stats.extra
        extra["compactions"] = extra.get("compactions", 0) + 1

    def _highest(self) -> int:
        return max((slot for slot, row in enumerate(self._slots) if row is not None), default=-1)
