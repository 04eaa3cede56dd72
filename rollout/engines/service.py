"""A thread-safe generation service over an HfEngine, for concurrent callers (the HTTP server).

One background thread owns the engine and steps one DecodeBatch (continuous batching): a request
submitted from any thread joins the running batch at the next step, its n samples sharing one
prefill. Its handle streams events as tokens are sampled and gives the list[Completion] at the
end; the handles of prompts submitted together (submit_many) stream through one queue, read with
merge_events as their tokens come, whichever prompt they belong to. Cancelling a handle (a client
went away) frees its rows at the next step. `close()` takes no new requests, finishes the ones in
flight, then stops the thread.

    with EngineService(engine) as service:
        handle = service.submit(prompt_ids, SamplingParams(max_new_tokens=64, n=2))
        for event in handle.events():
            print(event.sample, event.text, end="")
        completions = handle.result()
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch

from rollout.engines.base import Completion, EngineStats, FinishReason, SamplingParams
from rollout.engines.hf.decode_batch import DecodeBatch, GenerationRow
from rollout.engines.hf.engine import HfEngine, eval_mode

log = logging.getLogger("rollout.engines.service")

DEFAULT_MAX_BATCH_SIZE = 32
"""Most rows decoded together when neither the service nor the engine says."""

DEFAULT_MAX_REQUESTS = 256
"""Most requests queued or running at once; more are refused (ServiceBusy)."""


class ServiceClosed(RuntimeError):
    """The service is shutting down and takes no new requests."""


class ServiceBusy(RuntimeError):
    """Too many requests are queued or running."""


class RequestCancelled(RuntimeError):
    """The request was cancelled before it finished."""


@dataclass(frozen=True)
class TokenEvent:
    """New output of one of a request's samples.

    Text is released only once it cannot turn out to be the start of a stop string (and never
    half a UTF-8 character), so an event can carry no text, or text of earlier tokens. The
    tokens released with it are the ones whose text is all out: usually exactly one token. The
    sample's last event has its finish_reason, and the text and tokens that remained; over all of
    a sample's events, text and tokens add up to its Completion's text and token_ids.
    """

    sample: int
    """Which of the request's n completions (0 .. n-1)."""
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason | None = None
    completion: Completion | None = None
    """The sample's Completion, on its last event."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """The alternatives of each of token_ids, when the request asked for them."""


class RequestHandle:
    """One submitted request: its events as they come, its completions at the end."""

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        decode: Callable,
        *,
        events: queue.SimpleQueue[tuple[Any, ...]] | None = None,
        tag: int = 0,
        notify: Callable[[], None] | None = None,
    ) -> None:
        """`events` is the queue the engine thread reports to, shared by the handles submitted
        together; `tag` is this handle's place among them; `notify` is called after each event
        is queued (see EngineService.submit_many)."""
        self.prompt_ids = prompt_ids
        self.params = params
        self._decode = decode
        self._queue = events if events is not None else queue.SimpleQueue()
        self._tag = tag
        self._notify = notify or _nothing
        self._group: list[RequestHandle] = [self]
        self._completions: list[Completion | None] = [None] * params.n
        self._remaining = params.n
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._cancelled = False
        self._rows: list[GenerationRow] = []

    @property
    def done(self) -> bool:
        """Finished, failed or cancelled."""
        return self._done.is_set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Stop sampling this request (from any thread); its rows leave the batch at the next
        step. No effect once it is done."""
        if self._done.is_set():
            return
        self._cancelled = True
        for row in self._rows:
            row.cancelled = True
        self._queue.put((self._tag, "cancelled"))
        self._done.set()
        self._notify()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until done (finished, failed or cancelled); False if `timeout` passed first."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> list[Completion]:
        """The n completions, in sample order, once all have finished.

        Raises TimeoutError after `timeout` seconds, RequestCancelled if cancelled, and the
        engine's exception if a step failed.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"the request has not finished within {timeout} s")
        if self._error is not None:
            raise self._error
        if self._cancelled:
            raise RequestCancelled("the request was cancelled")
        return [completion for completion in self._completions if completion is not None]

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """The request's events, as its tokens are sampled, until every sample has finished.

        One consumer only. `timeout` bounds each wait for the next token (queue.Empty after it);
        the engine's exception is raised if a step failed; a cancelled request just ends. A
        handle submitted with others (submit_many) is read with merge_events instead.
        """
        if len(self._group) > 1:
            raise ValueError("this request was submitted with others: read them with merge_events")
        for _, event in merge_events([self], timeout):
            yield event

    # --- called by the engine thread ---------------------------------------------------------------

    def _on_token(self, sample: int, row: GenerationRow, token_id: int, logprob: float) -> None:
        top = row.top_logprobs[-1] if self.params.top_logprobs else None
        self._queue.put((self._tag, "token", sample, token_id, logprob, top))
        self._notify()

    def _finish(self, sample: int, completion: Completion) -> None:
        self._completions[sample] = completion
        self._queue.put((self._tag, "done", sample, completion))
        self._remaining -= 1
        if self._remaining == 0:
            self._done.set()
        self._notify()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._queue.put((self._tag, "error", error))
        self._done.set()
        self._notify()


def _nothing() -> None:
    pass


def merge_events(
    handles: Sequence[RequestHandle], timeout: float | None = None
) -> Iterator[tuple[int, TokenEvent]]:
    """The events of every handle of one submit_many call (all of them, in order), as they
    come, each with its handle's index, until every sample of every handle has finished.

    One consumer only. `timeout` bounds each wait for the next token (queue.Empty after it);
    the engine's exception is raised if a step failed; a cancelled handle's part just ends.
    """
    merger = EventMerger(handles)
    while not merger.finished:
        merged = merger.take(merger.queue.get(timeout=timeout))
        if merged is not None:
            yield merged


class EventMerger:
    """merge_events for a reader that must not block (an event loop): it takes what it finds
    on `queue` (get_nowait) and waits for submit_many's `notify` when there is nothing."""

    def __init__(self, handles: Sequence[RequestHandle]) -> None:
        if not handles or list(handles) != handles[0]._group:
            raise ValueError("merge_events takes every handle of one submit_many call, in order")
        self.queue = handles[0]._queue
        self._streams = [
            [
                _TextStream(h._decode, h.params.stop, h.params.top_logprobs > 0)
                for _ in range(h.params.n)
            ]
            for h in handles
        ]
        self._unfinished = [handle.params.n for handle in handles]

    @property
    def finished(self) -> bool:
        """Every sample of every handle has finished (or its handle was cancelled)."""
        return not any(self._unfinished)

    def take(self, item: tuple[Any, ...]) -> tuple[int, TokenEvent] | None:
        """The event (with its handle's index) one queued item makes, if it makes one; raises
        the engine's exception if a step failed."""
        tag, kind, *rest = item
        if not self._unfinished[tag]:
            return None  # a token sampled while its handle was being cancelled
        if kind == "token":
            sample, token_id, logprob, top = rest
            event = self._streams[tag][sample].push(sample, token_id, logprob, top)
            return None if event is None else (tag, event)
        if kind == "done":
            sample, completion = rest
            self._unfinished[tag] -= 1
            return tag, self._streams[tag][sample].finish(sample, completion)
        if kind == "error":
            raise rest[0]
        self._unfinished[tag] = 0  # cancelled
        return None


_Service = TypeVar("_Service", bound="QueuedService")


class QueuedService:
    """What every generation service shares: a background thread that owns an engine, an inbox
    of requests under one lock, submit/submit_many/close. A subclass says how a handle is
    prepared for its engine (`_prepare`) and what the thread does (`_run`)."""

    def __init__(
        self, engine: Any, decode: Callable[[list[int]], str], *, max_width: int, max_requests: int
    ) -> None:
        self._engine = engine
        self._max_width = max_width
        self._max_requests = max_requests
        self._decode = decode
        self._lock = threading.Condition()
        self._inbox: list[RequestHandle] = []
        self._in_flight = 0
        self._live_rows = 0
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="rollout-engine", daemon=True)
        self._thread.start()

    @property
    def engine(self) -> Any:
        return self._engine

    @property
    def stats(self) -> EngineStats:
        return self._engine.stats

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def occupancy(self) -> tuple[int, int]:
        """(rows sampled together at the last step or call, the most the batch takes): how full
        the engine's batch is, for /metrics. Read without the lock: a scrape may see a step old."""
        return self._live_rows, self._max_width

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> RequestHandle:
        """Queue one prompt (token ids) for `params.n` completions; thread-safe.

        Raises ValueError for an empty prompt, ServiceClosed after close(), ServiceBusy when
        max_requests are already queued or running.
        """
        return self.submit_many([prompt_ids], [params])[0]

    def submit_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        *,
        notify: Callable[[], None] | None = None,
    ) -> list[RequestHandle]:
        """Queue several prompts, each with its own parameters, as one request per prompt whose
        events share one queue (read them with merge_events); thread-safe. All are taken, or
        none: the errors are submit's. `notify` is called (from the engine thread, or one that
        cancels) after each event is queued and the handle's state updated: how an event loop
        learns of events without a thread blocked on the queue. It must not block.
        """
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameters")
        events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        handles = [
            RequestHandle(list(prompt), each, self._decode, events=events, tag=tag, notify=notify)
            for tag, (prompt, each) in enumerate(zip(prompts, params, strict=True))
        ]
        for handle in handles:
            handle._group = handles
            self._prepare(handle)
        with self._lock:
            if self._closing:
                raise ServiceClosed("the service is shutting down")
            if self._in_flight + len(handles) > self._max_requests:
                raise ServiceBusy(f"{self._in_flight} requests are already queued or running")
            self._in_flight += len(handles)
            self._inbox.extend(handles)
            self._lock.notify()
        return handles

    def close(self, timeout: float | None = None) -> None:
        """Take no new requests, finish those in flight, stop the thread (wait at most
        `timeout` seconds for it)."""
        with self._lock:
            self._closing = True
            self._lock.notify()
        self._thread.join(timeout)

    def __enter__(self: _Service) -> _Service:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prepare(self, handle: RequestHandle) -> None:
        """Ready a handle for this service's engine, in the caller's thread (may raise)."""

    def _run(self) -> None:
        raise NotImplementedError


class EngineService(QueuedService):
    """Runs an HfEngine in a background thread for concurrent callers. The service owns the
    engine while it runs: nothing else may call it until close() returns."""

    def __init__(
        self,
        engine: HfEngine,
        *,
        max_batch_size: int | None = None,
        max_requests: int = DEFAULT_MAX_REQUESTS,
    ) -> None:
        """`max_batch_size` caps the rows decoded together (default: the engine's, else
        DEFAULT_MAX_BATCH_SIZE); `max_requests` caps those queued or running."""
        super().__init__(
            engine,
            partial(engine.tokenizer.decode, skip_special_tokens=True),
            max_width=max_batch_size or engine.max_batch_size or DEFAULT_MAX_BATCH_SIZE,
            max_requests=max_requests,
        )

    @property
    def engine(self) -> HfEngine:
        return self._engine

    @property
    def stats(self) -> EngineStats:
        """The engine's counters; extra["max_live_rows"] is the most rows ever sampled at once."""
        return self._engine.stats

    def _prepare(self, handle: RequestHandle) -> None:
        handle._rows = self._engine.rows(handle.prompt_ids, handle.params)
        for sample, row in enumerate(handle._rows):
            row.listener = partial(handle._on_token, sample)

    # --- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        batch = self._engine.decode_batch(self._max_width)
        owners: dict[int, tuple[RequestHandle, int]] = {}
        with eval_mode(self._engine.model), torch.inference_mode():
            while True:
                with self._lock:
                    while not self._inbox and not batch.busy and not self._closing:
                        self._lock.wait()
                    arrived, self._inbox = self._inbox, []
                    if not arrived and not batch.busy:
                        break  # closing, and nothing left to do
                for handle in arrived:
                    batch.add(handle._rows)
                    for sample, row in enumerate(handle._rows):
                        owners[id(row)] = (handle, sample)
                self._step(batch, owners)

    def _step(self, batch: DecodeBatch, owners: dict[int, tuple[RequestHandle, int]]) -> None:
        """One batch step; hands finished rows to their requests and forgets finished and
        cancelled requests. A failing step fails every request in the batch, not the service."""
        try:
            for row in batch.step():
                handle, sample = owners.pop(id(row))
                if not handle.cancelled:
                    handle._finish(sample, self._engine.completion(row))
        except Exception as error:
            log.exception("an engine step failed; failing the requests in the batch")
            handles = {id(handle): handle for handle, _ in owners.values()}
            for handle in handles.values():
                handle._fail(error)
            batch.reset()
            owners.clear()
        gone = [key for key, (handle, _) in owners.items() if handle.cancelled]
        for key in gone:
            del owners[key]
        self._live_rows = len(batch.live_rows())
        with self._lock:
            self._in_flight = len({id(handle) for handle, _ in owners.values()}) + len(self._inbox)


class _TextStream:
    """One sample's text as it grows: releases text that no stop string can take back."""

    def __init__(
        self, decode: Callable[[Sequence[int]], str], stop: tuple[str, ...], top: bool
    ) -> None:
        self._decode = decode
        self._stop = stop
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._top: list[list[tuple[int, float]]] | None = [] if top else None
        self._released = 0
        self._text = ""

    def push(
        self, sample: int, token_id: int, logprob: float, top: list[tuple[int, float]] | None
    ) -> TokenEvent | None:
        self._token_ids.append(token_id)
        self._logprobs.append(logprob)
        if self._top is not None and top is not None:
            self._top.append(top)
        full = self._decode(self._token_ids)
        safe = releasable(full, self._stop)
        if not safe.startswith(self._text):
            return None  # the decoded text changed behind us: wait for the end
        delta, self._text = safe[len(self._text) :], safe
        tokens, logprobs = [], []
        alternatives = [] if self._top is not None else None
        if safe == full:  # nothing held back: every token so far is out
            tokens = self._token_ids[self._released :]
            logprobs = self._logprobs[self._released :]
            if self._top is not None:
                alternatives = self._top[self._released :]
            self._released = len(self._token_ids)
        if not delta and not tokens:
            return None
        return TokenEvent(sample, tokens, logprobs, delta, top_logprobs=alternatives)

    def finish(self, sample: int, completion: Completion) -> TokenEvent:
        text = completion.text
        delta = text[len(self._text) :] if text.startswith(self._text) else ""
        released = min(self._released, len(completion.token_ids))
        top = completion.top_logprobs
        return TokenEvent(
            sample,
            completion.token_ids[released:],
            completion.logprobs[released:],
            delta,
            completion.finish_reason,
            completion,
            top_logprobs=top[released:] if top is not None else None,
        )


def releasable(text: str, stop: Sequence[str]) -> str:
    """The part of a growing text that can be shown now: before the first stop string, without
    a trailing half character (U+FFFD from an incomplete UTF-8 sequence), and without a tail
    that may yet become a stop string."""
    found = [at for at in (text.find(s) for s in stop) if at >= 0]
    if found:
        return text[: min(found)]
    text = text.rstrip("\ufffd")
    held = max(
        (
            size
            for s in stop
            for size in range(1, min(len(s) - 1, len(text)) + 1)
            if text.endswith(s[:size])
        ),
        default=0,
    )
    return text[: len(text) - held]
