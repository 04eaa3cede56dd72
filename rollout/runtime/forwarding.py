"""Records of ranks on other nodes, forwarded to node 0's SQLite run store through the run's
key-value store.

A SQLite store is a file on node 0's machine. A multi-node run on it records as one on Postgres
does, with one difference: a worker on node K > 0 never opens the file. Its `BackgroundWriter`
writes into a `ForwardingStore` instead, which publishes each of the writer's transactions as one
JSON batch in the process group's store (torchrun's TCPStore, which node 0's agent hosts), and
global rank 0 (always on node 0) runs a `Forwarder` thread that writes those batches into the
SQLite store. The code that records (`write_metrics`, `write_log`, `write_samples`,
`write_checkpoint`, the
trackers) sees the same writer either way.

Keys, per forwarding rank R (`<ns>` is `records`):

- `<ns>/R/<n>`: batch n (1, 2, ...) as UTF-8 JSON, written with `compare_set` from empty;
- `<ns>/R/written`: how many batches R published, raised with `add` after the batch's key is
  set, so a reader that sees n there finds batches 1..n;
- `<ns>/R/closed`: raised once R's writer closed: `written` is final;
- `<ns>/R/beat`: raised every `beat_s` by R while it lives, so node 0 stops waiting for the
  records of a rank that died rather than for a fixed time.

Exactly once, in order: the forwarder keeps, per rank, the last batch it stored; it reads batches
strictly in sequence, writes a poll's batches in one SQLite transaction, and only then deletes
their keys. A batch's rows keep their per-rank order; rows of different ranks interleave as they
arrive (each carries its own time). Nothing is pickled: rows travel as JSON (NaN and infinities
as Python's json writes them, and reads them back).

Only non-blocking calls (`add`, `compare_set`, `check`, `delete_key`), as in
rollout/runtime/work_queue.py: the store is any torch.distributed `Store`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, Protocol

from rollout.storage.base import (
    CheckpointRecord,
    LogLevel,
    LogRow,
    MetricRecord,
    RunStore,
    SampleRecord,
)

log = logging.getLogger("rollout.forwarding")

NAMESPACE = "records"
_ABSENT = "\x00absent\x00"
"""`compare_set(key, x, x)` returns the key's value, or `x` when it does not exist (without
creating it): a read that never blocks. No batch is this string."""


class KeyValueStore(Protocol):
    """The torch.distributed `Store` calls forwarding makes (TCPStore, HashStore, PrefixStore)."""

    def add(self, key: str, amount: int) -> int: ...

    def check(self, keys: list[str]) -> bool: ...

    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...

    def delete_key(self, key: str) -> bool: ...


def _key(rank: int, part: object) -> str:
    return f"{NAMESPACE}/{rank}/{part}"


def _peek(store: KeyValueStore, key: str) -> str | None:
    value = store.compare_set(key, _ABSENT, _ABSENT).decode()
    return None if value == _ABSENT else value


# --- node K: the writer's store ------------------------------------------------------------------


class ForwardingStore:
    """What a `BackgroundWriter` on a rank of node K > 0 writes into: the part of `RunStore` the
    writer uses (`transaction`, `add_metrics`, `add_logs`, `add_samples`, `add_checkpoint`,
    `close`). Each
    transaction becomes one batch in `kv`; a beat thread shows node 0 that this rank lives."""

    def __init__(self, kv: KeyValueStore, rank: int, *, beat_s: float = 0.5) -> None:
        self.kv = kv
        self.rank = rank
        self._sent = 0
        self._rows: dict[str, list[Any]] | None = None
        self._stop = threading.Event()
        self._beat = threading.Thread(
            target=self._beat_loop, args=(beat_s,), name="rollout-records-beat", daemon=True
        )
        kv.add(_key(rank, "beat"), 1)
        self._beat.start()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        if self._rows is not None:  # nested: joins the outer batch
            yield
            return
        self._rows = {"metrics": [], "logs": [], "checkpoints": [], "samples": []}
        try:
            yield
            rows = self._rows
        finally:
            self._rows = None
        if any(rows.values()):
            self._publish(rows)

    def add_metrics(self, rows: Iterable[MetricRecord]) -> None:
        with self.transaction():
            assert self._rows is not None
            self._rows["metrics"] += [[r.run_id, r.step, r.name, r.value, r.time] for r in rows]

    def add_logs(self, rows: Iterable[LogRow]) -> None:
        with self.transaction():
            assert self._rows is not None
            self._rows["logs"] += [list(row) for row in rows]

    def add_samples(self, rows: Iterable[SampleRecord]) -> None:
        with self.transaction():
            assert self._rows is not None
            self._rows["samples"] += [asdict(row) for row in rows]

    def add_checkpoint(self, record: CheckpointRecord) -> None:
        with self.transaction():
            assert self._rows is not None
            self._rows["checkpoints"].append(
                [record.run_id, record.step, record.location, record.time]
            )

    def _publish(self, rows: dict[str, list[Any]]) -> None:
        n = self._sent + 1
        payload = json.dumps(rows, separators=(",", ":"), ensure_ascii=False)
        stored = self.kv.compare_set(_key(self.rank, n), "", payload).decode()
        if stored != payload:  # only a second writer for this rank in one run could do this
            raise RuntimeError(
                f"rank {self.rank}'s record batch {n} is already in the run's key-value store: "
                "two writers forward for one rank"
            )
        self._sent = n
        self.kv.add(_key(self.rank, "written"), 1)

    def close(self) -> None:
        """Say that every batch is published (the writer wrote its last transaction)."""
        self._stop.set()
        self._beat.join()
        self.kv.add(_key(self.rank, "closed"), 1)

    def _beat_loop(self, beat_s: float) -> None:
        while not self._stop.wait(beat_s):
            try:
                self.kv.add(_key(self.rank, "beat"), 1)
            except Exception:  # the store is gone (node 0 ended): the writer will say so
                return


class PendingStore:
    """The key-value store a forwarding writer's thread waits for: a worker's writer starts
    before the worker joins the process group (its first log lines queue meanwhile)."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._kv: KeyValueStore | None = None

    def provide(self, kv: KeyValueStore) -> None:
        self._kv = kv
        self._ready.set()

    def abandon(self) -> None:
        """The process group never formed: the writer's thread gives up (its rows are lost, and
        its close() says so)."""
        self._ready.set()

    def wait(self) -> KeyValueStore:
        self._ready.wait()
        if self._kv is None:
            raise RuntimeError(
                "this rank never joined the run's process group, through whose store its "
                "records reach node 0's SQLite run store"
            )
        return self._kv


# --- node 0: the forwarder -----------------------------------------------------------------------


class Forwarder:
    """On global rank 0: drain the batches of `ranks` from `kv` into the run store, in order,
    once each, from a thread of its own (which opens its own store connection), until `close`.

    `close(wait_s)` drains until every rank has closed its writer and everything it published is
    stored, or until a rank has shown no sign of life (no beat, no batch) for `silence_s`, or
    `wait_s` has passed; what could not be drained is said in the run store as a warning.
    """

    def __init__(
        self,
        kv: KeyValueStore,
        ranks: Sequence[int],
        open_store: Callable[[], RunStore],
        *,
        run_id: str,
        poll_s: float = 0.2,
        silence_s: float = 10.0,
    ) -> None:
        self.kv = kv
        self.ranks = list(ranks)
        self.run_id = run_id
        self.poll_s = poll_s
        self.silence_s = silence_s
        self.stored = dict.fromkeys(self.ranks, 0)
        """Per rank, the last batch written into the run store (and deleted from `kv`)."""
        self.rows = 0
        self.keys_left = -1
        """After `close`: how many forwarding keys stayed in the store (0 when all drained)."""
        self._open_store = open_store
        self._closing = threading.Event()
        self._wait_s = 0.0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rollout-records-in", daemon=True)
        self._thread.start()

    def close(self, wait_s: float = 60.0) -> None:
        """Drain what the other nodes' ranks still send (see the class), then stop; raise if
        writing into the run store failed."""
        self._wait_s = wait_s
        self._closing.set()
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"forwarding records into the run store failed: {self._error!r}")

    def _run(self) -> None:
        try:
            store = self._open_store()
            try:
                while not self._closing.wait(self.poll_s):
                    drain(self.kv, self.ranks, self.stored, store, self._count)
                missing = self._finish(store)
                if missing:
                    _warn(store, self.run_id, missing)
                for rank in self.ranks:
                    if rank not in missing:
                        self._forget(rank)
                self.keys_left = sum(self._keys_of(rank) for rank in self.ranks)
                _say(
                    store,
                    self.run_id,
                    "info",
                    f"forwarded {self.rows} records of rank(s) {_listed(self.ranks)} from their "
                    f"nodes; {self.keys_left} forwarding keys left in the run's key-value store",
                )
            finally:
                store.close()
        except BaseException as error:  # kept for close()
            self._error = error

    def _count(self, rows: int) -> None:
        self.rows += rows

    def _finish(self, store: RunStore) -> list[int]:
        """Drain until every rank closed and is drained; the ranks given up on."""
        deadline = time.monotonic() + self._wait_s
        signs = {rank: self._signs(rank) for rank in self.ranks}
        heard = dict.fromkeys(self.ranks, time.monotonic())
        while True:
            drain(self.kv, self.ranks, self.stored, store, self._count)
            now = time.monotonic()
            left = []
            for rank in self.ranks:
                if self._done(rank):
                    continue
                seen = self._signs(rank)
                if seen != signs[rank]:
                    signs[rank], heard[rank] = seen, now
                if now - heard[rank] < self.silence_s:
                    left.append(rank)
            if not left:
                return [rank for rank in self.ranks if not self._done(rank)]
            if now > deadline:
                return sorted(set(left) | {r for r in self.ranks if not self._done(r)})
            time.sleep(self.poll_s)

    def _forget(self, rank: int) -> None:
        """A drained rank's counters go too: the store ends the run as it began."""
        for part in ("written", "closed", "beat"):
            self.kv.delete_key(_key(rank, part))

    def _keys_of(self, rank: int) -> int:
        """How many of `rank`'s forwarding keys are still in the store (its counters, and the
        batch after the last one stored)."""
        parts = ("written", "closed", "beat", self.stored[rank] + 1)
        return sum(self.kv.check([_key(rank, part)]) for part in parts)

    def _signs(self, rank: int) -> tuple[int, int]:
        return self.kv.add(_key(rank, "beat"), 0), self.kv.add(_key(rank, "written"), 0)

    def _done(self, rank: int) -> bool:
        closed = self.kv.add(_key(rank, "closed"), 0) > 0
        return closed and self.stored[rank] >= self.kv.add(_key(rank, "written"), 0)


def drain(
    kv: KeyValueStore,
    ranks: Iterable[int],
    stored: dict[int, int],
    store: RunStore,
    on_rows: Callable[[int], None] = lambda rows: None,
) -> int:
    """Write every batch published since `stored` (per rank, the last one stored; updated) into
    `store` in one transaction, then delete their keys; the number of batches."""
    taken: list[tuple[int, int]] = []
    metrics: list[MetricRecord] = []
    logs: list[LogRow] = []
    checkpoints: list[CheckpointRecord] = []
    samples: list[SampleRecord] = []
    for rank in ranks:
        written = kv.add(_key(rank, "written"), 0)
        for n in range(stored[rank] + 1, written + 1):
            raw = _peek(kv, _key(rank, n))
            if raw is None:  # published means set first: only a foreign delete does this
                raise RuntimeError(f"rank {rank}'s record batch {n} is missing from the store")
            rows = json.loads(raw)
            metrics += [MetricRecord(*row) for row in rows["metrics"]]
            logs += [tuple(row) for row in rows["logs"]]  # type: ignore[misc]
            checkpoints += [CheckpointRecord(*row) for row in rows["checkpoints"]]
            samples += [SampleRecord(**row) for row in rows.get("samples", [])]
            taken.append((rank, n))
    if not taken:
        return 0
    with store.transaction():
        store.add_metrics(metrics)
        store.add_logs(logs)
        if samples:
            store.add_samples(samples)
        for checkpoint in checkpoints:
            store.add_checkpoint(checkpoint)
    # Stored, then forgotten: a crash in between re-sends nothing (the count lives here), and the
    # store does not grow with the run.
    for rank, n in taken:
        stored[rank] = max(stored[rank], n)
        kv.delete_key(_key(rank, n))
    on_rows(len(metrics) + len(logs) + len(checkpoints))
    return len(taken)


def _warn(store: RunStore, run_id: str, ranks: list[int]) -> None:
    message = (
        f"records of rank(s) {_listed(ranks)} stopped arriving from their node before their "
        "writers closed (the rank died, or its node was stopped): their last lines are in "
        "that node's torchrun-node-K.log"
    )
    log.warning("%s", message)
    _say(store, run_id, "warning", message)


def _say(store: RunStore, run_id: str, level: LogLevel, message: str) -> None:
    """A line of rank 0's own about forwarding, written beside the rows it forwarded."""
    with store.transaction():
        store.add_logs([(run_id, time.time(), level, 0, "forwarder", message)])


def _listed(ranks: Iterable[int]) -> str:
    return ", ".join(map(str, ranks))
