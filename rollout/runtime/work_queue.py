"""A step's prompts, shared by several actor processes through the run's key-value store.

Each training step has its own queue: the prompt indices 0..N-1 of the step, cut into chunks of
`chunk_size`. Actors claim chunks one at a time with the store's atomic `add` (two actors never
get the same chunk; a fast actor simply claims more: work stealing), generate, and publish the
chunk's results. The learner's collector waits until every chunk is done and reads the results
in item order, so a step's batch is the same whichever actor did which chunk.

Exactly once, even when an actor dies:

- A chunk is *done* when its results are written to `done/<chunk>` with `compare_set` from
  empty: the first completion wins, and a later one (from an actor that was presumed dead, or a
  second holder) finds the key taken and is ignored.
- A holder proves it is alive by incrementing the chunk's heartbeat counter from a background
  thread every `heartbeat_interval_s`. An actor with nothing left to claim watches the other
  chunks that are not done; one whose holder and heartbeat have not changed for `lease_s` (by the
  watcher's own clock, so no two machines' clocks are compared) is taken over with `compare_set`
  on its owner record, whose attempt number goes up by one: of several watchers, one wins.
- Work done twice costs time, never correctness: only one completion per chunk counts.

What travels here: each item's result is a small JSON value (a sample id, metadata); the chunk's
results are UTF-8 JSON in the store. Tensors never travel through the store: they stay on the
transport path (rollout/runtime/transport.py).

Steps are separate key namespaces (`<namespace>/<step>/...`). Releasing a step raises the
`consumed_through` mark, then deletes the step's keys, so an actor that touches a step afterwards
sees the mark, deletes whatever it wrote and stops: the store does not grow with the steps. Steps
are therefore collected in increasing order.

When to release: a completion that finds its step released reports that it did not count, which
is right for a late duplicate and wrong for the completion the collector has just read (its
holder, between its write and its check, would then drop results the collector expects). So a
collector that acts on its holders' completions (the learners wait for each counted chunk's rows)
collects with `release=False` and releases a step only once those are in: in a run, the step
before, when it collects the next (rollout/runtime/online/shared_prompts.py).

The store is any torch.distributed `Store` (a `TCPStore` in a run: `transport.process_group_store`
gives the default group's; a `HashStore` in one process). Only non-blocking calls are used (`add`,
`compare_set`, `check`, `delete_key`): a blocking `get` on a key the collector just deleted would
hang until the store's timeout.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol


class KeyValueStore(Protocol):
    """The torch.distributed `Store` calls this module makes (TCPStore, HashStore, PrefixStore)."""

    def add(self, key: str, amount: int) -> int: ...

    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def delete_key(self, key: str) -> bool: ...


class WorkQueueTimeout(RuntimeError):
    """The collector waited `timeout_s` and some chunks of the step are still not done."""


_ABSENT = "\x00absent\x00"
"""What `_peek` expects and writes back: `compare_set(key, x, x)` returns the key's value, or `x`
when the key does not exist (without creating it): a read that never blocks. No value this module
writes is this string."""


def _encode(value: Any) -> str:
    # Canonical JSON: the same record is the same bytes, which compare_set compares.
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class Chunk:
    """One claimed chunk: `items` are prompt indices of the step; `attempt` counts the holders
    before this one (0 for a fresh claim, 1 after one lease expired, ...)."""

    step: int
    index: int
    items: range
    attempt: int


@dataclass(frozen=True)
class PendingChunk:
    """A chunk that is not done: who holds it (None: nobody yet) and how often it was re-queued."""

    index: int
    items: range
    actor: str | None
    attempt: int

    def describe(self) -> str:
        items = f"items {self.items.start}-{self.items.stop - 1}"
        if self.actor is None:
            return f"chunk {self.index} ({items}, unclaimed)"
        return f"chunk {self.index} ({items}, held by {self.actor!r}, attempt {self.attempt})"


@dataclass
class ActorMetrics:
    """What one actor did on one step's queue."""

    chunks_claimed: int = 0
    items_claimed: int = 0
    chunks_requeued: int = 0
    """Chunks this actor took over from a holder whose lease had expired."""
    chunks_completed: int = 0
    """Completions that counted (the first for their chunk)."""
    completions_ignored: int = 0
    """Completions that came after another holder's (or after the step was collected)."""
    wait_s: float = 0.0
    """Seconds spent in `claim` with nothing to claim: waiting for other holders or leases."""

    def as_dict(self, prefix: str = "queue/") -> dict[str, float]:
        return {f"{prefix}{name}": float(value) for name, value in asdict(self).items()}


class WorkQueue:
    """The queue of one step: `num_items` prompt indices in chunks of `chunk_size`.

    Every actor and the collector build it with the same arguments; the first to touch the step
    records its shape, and a party that disagrees gets a ValueError rather than a wrong batch.
    """

    def __init__(
        self,
        store: KeyValueStore,
        step: int,
        num_items: int,
        chunk_size: int,
        *,
        lease_s: float = 60.0,
        poll_s: float = 0.05,
        namespace: str = "work_queue",
    ) -> None:
        if num_items < 1 or chunk_size < 1 or step < 0:
            raise ValueError(
                f"a work queue needs step >= 0, num_items >= 1 and chunk_size >= 1, "
                f"got step {step}, num_items {num_items}, chunk_size {chunk_size}"
            )
        if lease_s <= 0 or poll_s <= 0:
            raise ValueError(f"lease_s and poll_s must be positive, got {lease_s} and {poll_s}")
        self.store = store
        self.step = step
        self.num_items = num_items
        self.chunk_size = chunk_size
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.num_chunks = -(-num_items // chunk_size)
        self._root = f"{namespace}/consumed_through"
        self._prefix = f"{namespace}/{step}"

    # --- keys ------------------------------------------------------------------------------------

    def _key(self, *parts: object) -> str:
        return "/".join([self._prefix, *map(str, parts)])

    def items(self, chunk: int) -> range:
        return range(chunk * self.chunk_size, min((chunk + 1) * self.chunk_size, self.num_items))

    def _peek(self, key: str) -> str | None:
        value = self.store.compare_set(key, _ABSENT, _ABSENT).decode()
        return None if value == _ABSENT else value

    def _owner(self, chunk: int) -> tuple[str, dict[str, Any] | None]:
        """The chunk's owner record as stored ("" when none) and decoded."""
        raw = self._peek(self._key("owner", chunk))
        return ("", None) if raw is None else (raw, json.loads(raw))

    def consumed(self) -> bool:
        """Whether this step (or a later one) was collected and its keys deleted."""
        mark = self._peek(self._root)
        return mark is not None and int(mark) >= self.step

    def check_shape(self) -> None:
        shape = _encode([self.num_items, self.chunk_size])
        stored = self.store.compare_set(self._key("shape"), "", shape).decode()
        if stored != shape:
            raise ValueError(
                f"step {self.step}'s work queue has [num_items, chunk_size] {stored} in the store "
                f"but {shape} here: every actor and the collector must build it alike"
            )

    def _is_done(self, chunk: int) -> bool:
        return self.store.check([self._key("done", chunk)])

    # --- what is left ----------------------------------------------------------------------------

    def pending(self) -> list[PendingChunk]:
        """The chunks that are not done, with their holders."""
        left = []
        for chunk in range(self.num_chunks):
            if self._is_done(chunk):
                continue
            _, owner = self._owner(chunk)
            actor, attempt = (None, 0) if owner is None else (owner["actor"], owner["attempt"])
            left.append(PendingChunk(chunk, self.items(chunk), actor, attempt))
        return left

    # --- the collector ---------------------------------------------------------------------------

    def collect(self, timeout_s: float, *, release: bool = True) -> list[Any]:
        """Every item's result, in item order, once every chunk is done; then (with `release`)
        delete the step's keys, which makes a completion racing this call report False (see the
        module doc: a collector that waits on its holders releases later). Raises
        WorkQueueTimeout naming the chunks still missing and who held them when `timeout_s`
        passes first. One collector per step releases it."""
        if self.consumed():
            raise RuntimeError(
                f"work queue step {self.step} was already collected, or a later step was: "
                "steps are collected once each, in increasing order"
            )
        self.check_shape()
        done_keys = [self._key("done", chunk) for chunk in range(self.num_chunks)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(done_keys):
            if time.monotonic() >= deadline:
                missing = self.pending()
                raise WorkQueueTimeout(
                    f"work queue step {self.step}: {len(missing)} of {self.num_chunks} chunks not "
                    f"done after {timeout_s:g} s: " + "; ".join(c.describe() for c in missing)
                )
            time.sleep(self.poll_s)
        results: list[Any] = []
        for chunk, key in enumerate(done_keys):
            raw = self._peek(key)
            if raw is None:
                raise RuntimeError(
                    f"work queue step {self.step}: chunk {chunk} vanished while being read; was "
                    "the step collected by two collectors?"
                )
            results.extend(json.loads(raw)["results"])
        if release:
            self.release()
        return results

    def release(self) -> None:
        """Mark the step consumed, then delete its keys. The mark goes first so that an actor
        writing to the step afterwards sees it and deletes its own write (see the module doc)."""
        while True:
            raw = self._peek(self._root)
            if raw is not None and int(raw) >= self.step:
                break
            if self.store.compare_set(self._root, raw or "", str(self.step)).decode() == str(
                self.step
            ):
                break
        self._delete_keys()

    def _delete_keys(self) -> None:
        for chunk in range(self.num_chunks):
            _, owner = self._owner(chunk)
            last_attempt = 0 if owner is None else owner["attempt"]
            for attempt in range(last_attempt + 1):
                self.store.delete_key(self._key("beat", chunk, attempt))
            self.store.delete_key(self._key("owner", chunk))
            self.store.delete_key(self._key("done", chunk))
        self.store.delete_key(self._key("next"))
        self.store.delete_key(self._key("shape"))

    def actor(self, name: str, *, heartbeat_interval_s: float | None = None) -> QueueActor:
        return QueueActor(self, name, heartbeat_interval_s=heartbeat_interval_s)


class QueueActor:
    """One actor's side of a step's queue. Use as a context manager (it runs the heartbeat
    thread)::

        with queue.actor("actor-1") as actor:
            while (chunk := actor.claim()) is not None:
                actor.complete(chunk, [generate(i) for i in chunk.items])
    """

    def __init__(
        self, queue: WorkQueue, name: str, *, heartbeat_interval_s: float | None = None
    ) -> None:
        self.queue = queue
        self.name = name
        self.metrics = ActorMetrics()
        # Four beats per lease: one late beat (a busy host, a GC pause) is no expiry.
        self.heartbeat_interval_s = heartbeat_interval_s or queue.lease_s / 4
        self._held: dict[int, Chunk] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fresh_left = True
        self._watched: dict[int, tuple[str, str | None, float]] = {}
        self._seen_done: set[int] = set()  # done stays done: no need to ask the store again

    def __enter__(self) -> QueueActor:
        self.queue.check_shape()
        self._consumed_after_writing(self.queue._key("shape"))  # then claim() returns None
        self._thread = threading.Thread(
            target=self._beat_forever, name=f"work-queue-heartbeat-{self.name}", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    # --- claiming --------------------------------------------------------------------------------

    def claim(self) -> Chunk | None:
        """The next chunk for this actor, or None once every chunk of the step is done (or the
        step was collected). Takes a fresh chunk while there are any; then waits, watching the
        other holders' leases, and takes over a chunk whose lease expired."""
        started = time.monotonic()
        try:
            while not self.queue.consumed():
                if self._fresh_left:
                    chunk = self._claim_fresh()
                elif self._all_done():
                    return None
                else:
                    chunk = self._take_over_expired()
                if chunk is not None:
                    return self._hold(chunk)
                if not self._fresh_left:
                    time.sleep(self.queue.poll_s)
            return None
        finally:
            # Claiming a fresh chunk is one store round trip, not waiting: only a claim that
            # found the fresh chunks gone waited (for other holders, or for a lease to expire).
            if not self._fresh_left:
                self.metrics.wait_s += time.monotonic() - started

    def _claim_fresh(self) -> Chunk | None:
        queue = self.queue
        index = queue.store.add(queue._key("next"), 1) - 1
        if index >= queue.num_chunks:
            self._fresh_left = False
            return None
        # compare_set from empty, not set: a watcher may have taken the chunk over already if we
        # were slow between the add and this line (the lease ran out on a chunk with no owner).
        record = _encode({"actor": self.name, "attempt": 0})
        if queue.store.compare_set(queue._key("owner", index), "", record).decode() != record:
            return None  # lost it; the loop claims the next one
        return Chunk(queue.step, index, queue.items(index), 0)

    def _all_done(self) -> bool:
        queue = self.queue
        return queue.store.check([queue._key("done", c) for c in range(queue.num_chunks)])

    def _take_over_expired(self) -> Chunk | None:
        """Take over one chunk whose owner record and heartbeat have not moved for `lease_s`
        since this actor started watching them."""
        queue = self.queue
        now = time.monotonic()
        for index in range(queue.num_chunks):
            if index in self._seen_done or queue._is_done(index):
                self._seen_done.add(index)
                self._watched.pop(index, None)
                continue
            raw, owner = queue._owner(index)
            attempt = 0 if owner is None else owner["attempt"]
            beat = queue._peek(queue._key("beat", index, attempt))
            seen = self._watched.get(index)
            if seen is None or seen[:2] != (raw, beat):
                self._watched[index] = (raw, beat, now)
                continue
            if now - seen[2] < queue.lease_s:
                continue
            taken = _encode({"actor": self.name, "attempt": attempt + 1})
            self._watched.pop(index, None)
            if queue.store.compare_set(queue._key("owner", index), raw, taken).decode() == taken:
                self.metrics.chunks_requeued += 1
                return Chunk(queue.step, index, queue.items(index), attempt + 1)
        return None

    def _hold(self, chunk: Chunk) -> Chunk | None:
        queue = self.queue
        self._beat(chunk)  # the heartbeat key exists from the claim on: watchers see it move
        if self._consumed_after_writing(
            queue._key("next"),
            queue._key("owner", chunk.index),
            queue._key("beat", chunk.index, chunk.attempt),
        ):
            return None
        self.metrics.chunks_claimed += 1
        self.metrics.items_claimed += len(chunk.items)
        with self._lock:
            self._held[chunk.index] = chunk
        return chunk

    def _consumed_after_writing(self, *keys: str) -> bool:
        """Whether the step was collected; if so, delete `keys`, which this actor just wrote.
        The collector raises the mark before deleting, so a write it could have missed is one
        whose writer sees the mark here."""
        if not self.queue.consumed():
            return False
        for key in keys:
            self.queue.store.delete_key(key)
        return True

    # --- completing ------------------------------------------------------------------------------

    def complete(self, chunk: Chunk, results: list[Any]) -> bool:
        """Publish `results` (one JSON value per item of the chunk, in item order). True if
        they count; False if another holder completed the chunk first or the step was already
        collected (the results are then dropped)."""
        if len(results) != len(chunk.items):
            raise ValueError(
                f"chunk {chunk.index} of step {chunk.step} has {len(chunk.items)} items but "
                f"{len(results)} results were given"
            )
        with self._lock:
            self._held.pop(chunk.index, None)
        queue = self.queue
        payload = _encode({"actor": self.name, "attempt": chunk.attempt, "results": results})
        stored = queue.store.compare_set(queue._key("done", chunk.index), "", payload).decode()
        counted = stored == payload and not self._consumed_after_writing(
            queue._key("done", chunk.index)
        )
        if counted:
            self.metrics.chunks_completed += 1
        else:
            self.metrics.completions_ignored += 1
        return counted

    # --- heartbeat -------------------------------------------------------------------------------

    def _beat(self, chunk: Chunk) -> None:
        self.queue.store.add(self.queue._key("beat", chunk.index, chunk.attempt), 1)

    def _beat_forever(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_s):
            with self._lock:
                held = list(self._held.values())
            if not held:
                continue
            for chunk in held:
                self._beat(chunk)
            keys = [self.queue._key("beat", chunk.index, chunk.attempt) for chunk in held]
            if self._consumed_after_writing(*keys):
                with self._lock:
                    self._held.clear()
