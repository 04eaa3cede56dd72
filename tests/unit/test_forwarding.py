"""Forwarding other nodes' records into node 0's SQLite store, on an in-process key-value store:
every row arrives once and in its rank's order, a failed write is retried without duplicates, a
rank that goes silent is given up on with a warning, and no key is left behind. The same code on
two real nodes: tests/integration/test_multi_node.py."""

from __future__ import annotations

import math
import threading

import pytest
import torch.distributed as dist

from rollout.runtime.forwarding import (
    NAMESPACE,
    Forwarder,
    ForwardingStore,
    PendingStore,
    drain,
)
from rollout.storage import open_store
from rollout.storage.base import MetricRecord, SampleRecord
from rollout.storage.writer import BackgroundWriter

RUN = "run-1"


@pytest.fixture
def kv() -> dist.HashStore:
    return dist.HashStore()


@pytest.fixture
def location(tmp_path) -> str:
    location = f"sqlite:{tmp_path / 'rollout.db'}"
    with open_store(location) as store:
        store.create_run(RUN, name="r", plan_sha256="0" * 64, plan_path="p", run_dir="d")
    return location


def _forwarding_writer(kv, rank: int) -> BackgroundWriter:
    # A small max_batch: many batches per rank, so order across batches is tested.
    return BackgroundWriter(lambda: ForwardingStore(kv, rank, beat_s=0.02), max_batch=7)


def _keys_left(kv, ranks, upto: int = 200) -> list[str]:
    parts = ["written", "closed", "beat", *range(1, upto)]
    keys = [f"{NAMESPACE}/{rank}/{part}" for rank in ranks for part in parts]
    return [key for key in keys if kv.check([key])]


def test_two_ranks_rows_arrive_once_in_each_ranks_order_and_no_key_is_left(kv, location):
    forwarder = Forwarder(kv, [1, 2], lambda: open_store(location), run_id=RUN, poll_s=0.01)

    def record(rank: int) -> None:
        with _forwarding_writer(kv, rank) as writer:
            for i in range(60):
                writer.write_log(RUN, "info", rank, "learner", f"rank {rank} line {i}")
                if i % 10 == 0:
                    writer.write_metrics(RUN, i + rank * 1000, {"m": float(i), "nan": math.nan})
            writer.write_checkpoint(RUN, 5 + rank, f"/ckpt/{rank}")
            turns = [{"role": "assistant", "content": "ünï"}]
            writer.write_samples(
                [SampleRecord(RUN, rank, 0, "p", None, turns, math.nan, {"r": rank}, 0.0)]
            )

    threads = [threading.Thread(target=record, args=(rank,)) for rank in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    forwarder.close(wait_s=10)

    with open_store(location) as store:
        for rank in (1, 2):
            lines = [r.message for r in store.logs(RUN, rank=rank, limit=1000)]
            assert lines == [f"rank {rank} line {i}" for i in range(60)]  # once, in order
        metrics = store.metrics(RUN, ["m"])
        assert len(metrics) == 12 and len({(m.step, m.name) for m in metrics}) == 12
        assert all(math.isnan(m.value) for m in store.metrics(RUN, ["nan"]))  # JSON keeps NaN
        assert [(c.step, c.location) for c in store.checkpoints(RUN)] == [
            (6, "/ckpt/1"),
            (7, "/ckpt/2"),
        ]
        samples = store.samples(RUN)
        assert [(x.step, x.extra, x.turns[0]["content"]) for x in samples] == [
            (1, {"r": 1}, "ünï"),
            (2, {"r": 2}, "ünï"),
        ]
        assert all(math.isnan(x.reward) for x in samples)
    assert forwarder.rows == 2 * (60 + 12 + 1)
    with open_store(location) as store:
        (said,) = store.logs(RUN, role="forwarder")
        assert said.message.startswith("forwarded 146 records of rank(s) 1, 2")
        assert "0 forwarding keys left" in said.message
    assert forwarder.keys_left == 0 and _keys_left(kv, [1, 2]) == []


def test_a_failed_store_write_keeps_the_batches_and_a_retry_stores_them_once(kv, location):
    producer = ForwardingStore(kv, 1, beat_s=60)
    for step in (1, 2, 3):
        producer.add_metrics([MetricRecord(RUN, step, "m", float(step), 0.0)])
    producer.close()

    class Failing:
        """A store whose writes fail inside the transaction (a disk error, say)."""

        def __init__(self, inner):
            self.inner = inner

        def transaction(self):
            return self.inner.transaction()

        def add_metrics(self, rows):
            raise OSError("disk full")

    stored = {1: 0}
    with open_store(location) as store:
        with pytest.raises(OSError):
            drain(kv, [1], stored, Failing(store))
        assert stored == {1: 0} and kv.check([f"{NAMESPACE}/1/1"])  # nothing forgotten
        assert drain(kv, [1], stored, store) == 3
        assert drain(kv, [1], stored, store) == 0  # a second drain finds nothing new
        assert [m.step for m in store.metrics(RUN)] == [1, 2, 3]
    assert stored == {1: 3}


def test_a_rank_that_goes_silent_is_given_up_on_with_a_warning(kv, location):
    producer = ForwardingStore(kv, 1, beat_s=60)  # beats once, at start, then never
    producer.add_logs([(RUN, 1.0, "info", 1, "learner", "before it died")])
    forwarder = Forwarder(
        kv, [1, 2], lambda: open_store(location), run_id=RUN, poll_s=0.01, silence_s=0.3
    )
    ForwardingStore(kv, 2, beat_s=0.02).close()
    forwarder.close(wait_s=30)  # rank 1 never closes: 0.3 s of silence, not 30 s
    with open_store(location) as store:
        assert [r.message for r in store.logs(RUN, rank=1)] == ["before it died"]
        (warning,) = store.logs(RUN, level="warning")
        assert "rank(s) 1 stopped arriving" in warning.message
    assert _keys_left(kv, [2]) == []  # rank 2 closed and is forgotten; rank 1 is kept


def test_a_writer_waits_for_the_process_group_and_says_so_when_it_never_forms(kv, location):
    pending = PendingStore()
    writer = BackgroundWriter(lambda: ForwardingStore(pending.wait(), 1, beat_s=0.02))
    writer.write_log(RUN, "info", 1, "learner", "queued before the group formed")
    pending.provide(kv)
    forwarder = Forwarder(kv, [1], lambda: open_store(location), run_id=RUN, poll_s=0.01)
    writer.close()
    forwarder.close(wait_s=10)
    with open_store(location) as store:
        assert [r.message for r in store.logs(RUN, rank=1)] == ["queued before the group formed"]

    never = PendingStore()
    orphan = BackgroundWriter(lambda: ForwardingStore(never.wait(), 1))
    never.abandon()
    with pytest.raises(Exception, match="never joined the run's process group"):
        orphan.close()
