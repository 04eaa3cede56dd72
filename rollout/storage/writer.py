"""Writing to the run store off the hot path.

The generation and learner loops call `write_metrics`, `write_log`, `write_samples` and
`write_checkpoint`; those
only put a row on an in-memory queue and return. A daemon thread owns its own store connection,
drains the queue, and writes each batch in one transaction, every `flush_interval_s` or every
`max_batch` rows. The queue is unbounded on purpose: a slow disk costs memory, never a step.

If a write fails, the writer stops writing, keeps the error, and `flush()` and `close()` raise it
(as `WriterError`) from then on: rows are never lost silently.

Metric sinks (the [logging] trackers) see every metric row after the run store has it: the thread
hands each transaction's rows to every sink, and closes the sinks when it stops, on every path. A
sink that raises is dropped with a warning; the run store never waits on a sink's failure.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rollout.redact import redact_text
from rollout.storage.base import (
    CheckpointRecord,
    LogLevel,
    LogRow,
    MetricRecord,
    RunStore,
    SampleRecord,
)

_STOP = object()
_LIVENESS_CHECK_S = 0.1

log = logging.getLogger("rollout.storage.writer")


class WriterError(RuntimeError):
    """The background writer could not write to the run store; rows after the failure were lost."""


class MetricSink(Protocol):
    """Receives every metric row once the run store has it (a tracker, say).

    Both methods run on the writer's thread: `log` after each transaction, with the rows it
    wrote, so it must return quickly (hand slow work to a thread of its own); `close` once, when
    the writer stops. What a sink logs while closing is still written to the store.
    """

    name: str

    def log(self, rows: Sequence[MetricRecord]) -> None: ...

    def close(self) -> None: ...


@dataclass
class _Batch:
    metrics: list[MetricRecord] = field(default_factory=list)
    logs: list[LogRow] = field(default_factory=list)
    checkpoints: list[CheckpointRecord] = field(default_factory=list)
    samples: list[SampleRecord] = field(default_factory=list)
    flushed: list[threading.Event] = field(default_factory=list)
    stop: bool = False

    def add(self, item: object) -> None:
        if isinstance(item, MetricRecord):
            self.metrics.append(item)
        elif isinstance(item, CheckpointRecord):
            self.checkpoints.append(item)
        elif isinstance(item, SampleRecord):
            self.samples.append(item)
        else:
            self.logs.append(item)  # a LogRow tuple

    @property
    def rows(self) -> int:
        return len(self.metrics) + len(self.logs) + len(self.checkpoints) + len(self.samples)

    def write(self, store: RunStore) -> None:
        if not self.rows:
            return
        with store.transaction():
            store.add_metrics(self.metrics)
            store.add_logs(self.logs)
            if self.samples:  # recorded by global rank 0 only, never through forwarding
                store.add_samples(self.samples)
            for checkpoint in self.checkpoints:
                store.add_checkpoint(checkpoint)


class BackgroundWriter:
    """Queue rows for the run store; a daemon thread writes them in batches.

    `open_store` is called inside the thread, because a store connection belongs to the thread
    that opened it. Use as a context manager, or call `close()`: rows still queued when the
    process exits without it are lost.
    """

    def __init__(
        self,
        open_store: Callable[[], RunStore],
        *,
        flush_interval_s: float = 0.5,
        max_batch: int = 500,
        sinks: Sequence[MetricSink] = (),
    ) -> None:
        self._open_store = open_store
        self._sinks = list(sinks)
        self._flush_interval_s = flush_interval_s
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._closed = False
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rollout-store-writer", daemon=True)
        self._thread.start()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # --- the hot path: enqueue and return

    def write_metrics(self, run_id: str, step: int, values: Mapping[str, float]) -> None:
        """Values are converted with float() now, in the caller, so a bad value fails here."""
        now = time.time()
        for name, value in values.items():
            self._put(MetricRecord(run_id, step, name, float(value), now))

    def write_log(
        self,
        run_id: str,
        level: LogLevel,
        rank: int,
        role: str,
        message: str,
        *,
        time_s: float | None = None,
    ) -> None:
        self._put((run_id, time.time() if time_s is None else time_s, level, rank, role, message))

    def write_checkpoint(self, run_id: str, step: int, location: str) -> None:
        self._put(CheckpointRecord(run_id, step, location, time.time()))

    def write_samples(self, samples: Sequence[SampleRecord]) -> None:
        for sample in samples:
            self._put(sample)

    def _put(self, item: object) -> None:
        # While closing, the thread still takes what its sinks log (they close on that thread).
        if self._closed and not self._thread.is_alive():
            raise RuntimeError("the run store writer is closed")
        self._queue.put(item)

    # --- waiting for the thread

    def flush(self) -> None:
        """Block until every row queued before this call is written; raise if writing failed."""
        self._raise_if_failed()
        if self._closed:
            return
        done = threading.Event()
        self._queue.put(done)
        # The thread may die (and stop reading the queue) before it reaches our marker.
        while not done.wait(_LIVENESS_CHECK_S) and self._thread.is_alive():
            pass
        self._raise_if_failed()

    def close(self) -> None:
        """Write what is queued, stop the thread; raise if writing failed. Safe to call twice."""
        with self._close_lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
                self._thread.join()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise WriterError(f"writing to the run store failed: {self._error!r}") from self._error

    # --- the thread

    def _run(self) -> None:
        batch = _Batch()
        try:
            store = self._open_store()
            try:
                while not batch.stop:
                    batch = self._collect()
                    batch.write(store)
                    self._feed_sinks(batch.metrics)
                    _release(batch)
                self._close_sinks()
                self._write_late_rows(store)
            finally:
                store.close()
        except BaseException as error:  # kept for flush()/close(), whatever it was
            self._error = error
            _release(batch)
        finally:
            self._close_sinks()  # when the store failed: the trackers still end cleanly

    def _feed_sinks(self, metrics: list[MetricRecord]) -> None:
        if not metrics:
            return
        rows = tuple(metrics)  # one read-only batch for every sink
        for sink in list(self._sinks):
            try:
                sink.log(rows)
            except Exception as error:
                self._sinks.remove(sink)
                log.warning("metric sink %s failed and is dropped: %r", sink.name, error)
                _close_sink(sink)

    def _close_sinks(self) -> None:
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            _close_sink(sink)

    def _write_late_rows(self, store: RunStore) -> None:
        """Write what was queued after the stop: what the sinks logged while closing."""
        batch = _Batch()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, threading.Event):
                batch.flushed.append(item)
            elif item is not _STOP:
                batch.add(item)
        batch.write(store)
        _release(batch)

    def _collect(self) -> _Batch:
        """Block for a first item, then gather until the interval ends, the batch is full, or a
        flush or stop asks for it now."""
        batch = _Batch()
        item = self._queue.get()
        deadline = time.monotonic() + self._flush_interval_s
        while True:
            if item is _STOP:
                batch.stop = True
                return batch
            if isinstance(item, threading.Event):
                batch.flushed.append(item)
                return batch
            batch.add(item)
            if batch.rows >= self._max_batch:
                return batch
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return batch


def _release(batch: _Batch) -> None:
    for event in batch.flushed:
        event.set()


def _close_sink(sink: MetricSink) -> None:
    try:
        sink.close()
    except Exception as error:
        log.warning("metric sink %s failed to close: %r", sink.name, error)


_LEVELS: tuple[tuple[int, LogLevel], ...] = (
    (logging.ERROR, "error"),
    (logging.WARNING, "warning"),
    (logging.INFO, "info"),
)


class StoreLogHandler(logging.Handler):
    """Send standard `logging` records to the run store through a `BackgroundWriter`.

    CRITICAL is stored as 'error' and anything below INFO as 'debug'. Formatting runs in the
    caller; the write does not.
    """

    def __init__(self, writer: BackgroundWriter, run_id: str, rank: int, role: str) -> None:
        super().__init__()
        self.writer = writer
        self.run_id = run_id
        self.rank = rank
        self.role = role

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.writer.write_log(
                self.run_id,
                store_level(record.levelno),
                self.rank,
                self.role,
                redact_text(self.format(record)),
                time_s=record.created,
            )
        except Exception:
            self.handleError(record)


def store_level(levelno: int) -> LogLevel:
    """The run store's level for a `logging` level number."""
    return next((level for threshold, level in _LEVELS if levelno >= threshold), "debug")
