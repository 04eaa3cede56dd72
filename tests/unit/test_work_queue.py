"""The work queue's rules on an in-process store: claims never overlap, an expired lease re-queues
a chunk, the first completion wins, the collector reads item order and deletes the step's keys.
Real processes on a TCPStore: tests/integration/test_work_queue_processes.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from rollout.runtime.work_queue import WorkQueue, WorkQueueTimeout

NEVER = 3600.0  # a heartbeat interval that never comes: the holder looks dead


@pytest.fixture
def store() -> dist.HashStore:
    return dist.HashStore()


def _queue(store, step=0, num_items=10, chunk_size=4, lease_s=0.2) -> WorkQueue:
    return WorkQueue(store, step, num_items, chunk_size, lease_s=lease_s, poll_s=0.01)


def _work_through(actor) -> list[int]:
    """Claim and complete until the step is done; the chunk indices this actor completed."""
    done = []
    while (chunk := actor.claim()) is not None:
        if actor.complete(chunk, [item * 10 for item in chunk.items]):
            done.append(chunk.index)
    return done


def test_one_actor_takes_every_chunk_and_the_collector_reads_item_order(store) -> None:
    queue = _queue(store)
    with queue.actor("a") as actor:
        assert _work_through(actor) == [0, 1, 2]
    assert [list(queue.items(chunk)) for chunk in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]
    assert queue.collect(timeout_s=1) == [item * 10 for item in range(10)]
    assert actor.metrics.chunks_claimed == 3 and actor.metrics.items_claimed == 10
    assert actor.metrics.chunks_requeued == 0 and actor.metrics.completions_ignored == 0


def test_chunks_completed_out_of_order_are_still_collected_in_item_order(store) -> None:
    queue = _queue(store)
    with queue.actor("a") as actor:
        chunks = [actor.claim() for _ in range(3)]
        for chunk in reversed(chunks):
            assert actor.complete(chunk, [f"r{item}" for item in chunk.items])
    assert queue.collect(timeout_s=1) == [f"r{item}" for item in range(10)]


def test_actors_in_threads_never_claim_the_same_chunk(store) -> None:
    queue = _queue(store, num_items=100, chunk_size=4)
    claimed: dict[str, list[int]] = {}

    def run(name: str) -> None:
        with queue.actor(name) as actor:
            claimed[name] = _work_through(actor)

    threads = [threading.Thread(target=run, args=(f"a{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = sorted(index for indices in claimed.values() for index in indices)
    assert every == list(range(25))
    assert queue.collect(timeout_s=1) == [item * 10 for item in range(100)]


def test_an_expired_lease_requeues_the_chunk_and_a_late_completion_is_ignored(store) -> None:
    queue = _queue(store, num_items=4)
    with queue.actor("dead", heartbeat_interval_s=NEVER) as dead, queue.actor("b") as alive:
        lost = dead.claim()
        started = time.monotonic()
        taken = alive.claim()
        waited = time.monotonic() - started
        assert (taken.index, taken.attempt, lost.attempt) == (0, 1, 0)
        assert waited >= queue.lease_s
        assert alive.complete(taken, ["by b"] * 4)
        assert not dead.complete(lost, ["by dead"] * 4)
    assert queue.collect(timeout_s=1) == ["by b"] * 4
    assert alive.metrics.chunks_requeued == 1 and alive.metrics.wait_s >= queue.lease_s
    assert dead.metrics.completions_ignored == 1 and dead.metrics.chunks_completed == 0


def test_the_first_completion_wins_even_from_a_holder_presumed_dead(store) -> None:
    queue = _queue(store, num_items=4)
    with queue.actor("slow", heartbeat_interval_s=NEVER) as slow, queue.actor("b") as other:
        first = slow.claim()
        second = other.claim()
        assert slow.complete(first, ["by slow"] * 4)
        assert not other.complete(second, ["by b"] * 4)
    assert queue.collect(timeout_s=1) == ["by slow"] * 4


def test_a_holder_that_keeps_beating_keeps_its_chunk(store) -> None:
    queue = _queue(store, num_items=4)
    with queue.actor("busy") as busy, queue.actor("idle") as idle:
        chunk = busy.claim()
        got: list = []
        waiting = threading.Thread(target=lambda: got.append(idle.claim()))
        waiting.start()
        time.sleep(4 * queue.lease_s)
        assert waiting.is_alive()  # still waiting: the live holder's chunk was not taken
        assert busy.complete(chunk, [0] * 4)
        waiting.join(timeout=5)
    assert got == [None]
    assert idle.metrics.chunks_requeued == 0 and idle.metrics.wait_s >= 3 * queue.lease_s


def test_a_collector_timeout_names_the_missing_chunks_and_their_holders(store) -> None:
    queue = _queue(store, step=7)
    with queue.actor("actor-2") as actor:
        first, _second = actor.claim(), actor.claim()
        actor.complete(first, [0] * 4)
        with pytest.raises(WorkQueueTimeout) as raised:
            queue.collect(timeout_s=0.05)
    message = str(raised.value)
    assert "step 7: 2 of 3 chunks not done after 0.05 s" in message
    assert "chunk 1 (items 4-7, held by 'actor-2', attempt 0)" in message
    assert "chunk 2 (items 8-9, unclaimed)" in message
    assert "chunk 0" not in message


def test_collecting_deletes_the_steps_keys_so_the_store_does_not_grow(store) -> None:
    before = store.num_keys()
    for step in range(3):
        queue = _queue(store, step=step, num_items=8)
        with queue.actor("dead", heartbeat_interval_s=NEVER) as dead, queue.actor("b") as b:
            dead.claim()  # its chunk is re-queued: attempts 0 and 1 both leave heartbeat keys
            assert _work_through(b) == [1, 0]
        assert queue.collect(timeout_s=1) == [item * 10 for item in range(8)]
        assert store.num_keys() == before + 1  # the consumed-through mark, shared by every step


def test_a_holder_that_outlives_its_lease_and_the_step_leaves_no_keys_behind(store) -> None:
    """It beats less often than the lease, so its chunk is taken over and the step collected
    while it still holds it: its next heartbeat and its completion find the step gone and
    delete what they wrote."""
    queue = _queue(store, num_items=4)
    before = store.num_keys()
    with queue.actor("laggard", heartbeat_interval_s=0.5) as laggard, queue.actor("b") as b:
        held = laggard.claim()
        assert _work_through(b) == [0]
        assert queue.collect(timeout_s=1) == [0, 10, 20, 30]
        time.sleep(0.6)  # the laggard's heartbeat comes
        assert store.num_keys() == before + 1
        assert not laggard.complete(held, [1] * 4)
    with queue.actor("after") as after:
        assert after.claim() is None
    assert store.num_keys() == before + 1
    with pytest.raises(RuntimeError, match="already collected"):
        queue.collect(timeout_s=1)


def test_steps_are_separate_namespaces(store) -> None:
    one, two = _queue(store, step=1, num_items=4), _queue(store, step=2, num_items=6)
    with one.actor("a") as a1, two.actor("a") as a2:
        c1, c2 = a1.claim(), a2.claim()
        a2.complete(c2, ["two"] * 4)
        a1.complete(c1, ["one"] * 4)
        a2.complete(a2.claim(), ["two"] * 2)
    assert one.collect(timeout_s=1) == ["one"] * 4
    assert two.collect(timeout_s=1) == ["two"] * 6


def test_parties_that_disagree_on_the_shape_are_refused(store) -> None:
    with _queue(store, num_items=10).actor("a"):
        pass
    with pytest.raises(ValueError, match=r"\[num_items, chunk_size\] \[10,4\] in the store"):
        _queue(store, num_items=12).collect(timeout_s=1)


def test_a_result_per_item_is_required(store) -> None:
    with _queue(store).actor("a") as actor:
        chunk = actor.claim()
        with pytest.raises(ValueError, match="chunk 0 of step 0 has 4 items but 3 results"):
            actor.complete(chunk, [0, 1, 2])


def test_metrics_are_named_for_recording(store) -> None:
    with _queue(store).actor("a") as actor:
        _work_through(actor)
    metrics = actor.metrics.as_dict()
    assert metrics["queue/chunks_claimed"] == 3.0 and metrics["queue/items_claimed"] == 10.0
    assert set(metrics) >= {"queue/chunks_requeued", "queue/wait_s", "queue/completions_ignored"}


def test_a_queue_needs_items_whole_chunks_and_a_positive_lease(store) -> None:
    with pytest.raises(ValueError, match="got step 0, num_items 0, chunk_size 4"):
        _queue(store, num_items=0)
    with pytest.raises(ValueError, match="got step 0, num_items 4, chunk_size 0"):
        _queue(store, num_items=4, chunk_size=0)
    with pytest.raises(ValueError, match="lease_s and poll_s must be positive, got 0"):
        _queue(store, lease_s=0)


class _CollectRightAfterACompletion:
    """A store on which the collector runs right after the first completion's write lands,
    before its holder checks whether the step was released: the race a loaded machine runs."""

    def __init__(self, store):
        self.store = store
        self.collector = None

    def __getattr__(self, name):
        return getattr(self.store, name)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        value = self.store.compare_set(key, expected, desired)
        if "/done/" in key and expected == "" and self.collector is not None:
            collector, self.collector = self.collector, None
            collector()
        return value


@pytest.mark.parametrize("release", [True, False])
def test_a_completion_the_collector_read_counts_unless_the_step_was_released_at_once(
    store, release
) -> None:
    racing = _CollectRightAfterACompletion(store)
    queue = _queue(racing, num_items=4)
    collected = []
    racing.collector = lambda: collected.append(queue.collect(timeout_s=1, release=release))
    with queue.actor("a") as actor:
        counted = actor.complete(actor.claim(), [1, 2, 3, 4])
    assert collected == [[1, 2, 3, 4]]  # the collector read this completion...
    # ...and its holder (which sends the chunk's rows only when it counted) knows it only if the
    # step was not released in the same breath: why a run's learner releases a step later.
    assert counted is not release
    queue.release()  # later, a completion of the step is a late duplicate
    with queue.actor("late") as late:
        assert late.claim() is None
