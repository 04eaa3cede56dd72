"""The background writer: batching, flush semantics, a hot path that never waits, loud failures."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager

import pytest

from rollout.storage import open_store
from rollout.storage.writer import BackgroundWriter, StoreLogHandler, WriterError, store_level

SLOW = 60.0  # a flush interval no test waits for: flush() and close() must not need it


class RecordingStore:
    """A store that records each transaction's rows; optionally blocks or fails inside one."""

    def __init__(self, *, gate: threading.Event | None = None, fail: Exception | None = None):
        self.transactions: list[list[tuple[str, object]]] = []
        self.gate = gate
        self.fail = fail
        self.closed = False

    @contextmanager
    def transaction(self):
        self.transactions.append([])
        if self.gate:
            self.gate.wait()
        if self.fail:
            raise self.fail
        yield

    def add_metrics(self, rows):
        self.transactions[-1] += [("metric", row) for row in rows]

    def add_logs(self, rows):
        self.transactions[-1] += [("log", row) for row in rows]

    def add_checkpoint(self, record):
        self.transactions[-1].append(("checkpoint", record))

    def close(self):
        self.closed = True


def test_rows_written_together_go_in_one_transaction():
    store = RecordingStore()
    with BackgroundWriter(lambda: store, flush_interval_s=SLOW) as writer:
        writer.write_metrics("r", 1, {"loss": 0.5, "reward": 1})
        writer.write_log("r", "info", 0, "learner", "hello")
        writer.write_checkpoint("r", 1, "/c/1")
        writer.flush()
    assert len(store.transactions) == 1
    assert [kind for kind, _ in store.transactions[0]] == ["metric", "metric", "log", "checkpoint"]
    assert store.closed


def test_max_batch_splits_transactions():
    store = RecordingStore()
    with BackgroundWriter(lambda: store, flush_interval_s=SLOW, max_batch=4) as writer:
        for index in range(10):
            writer.write_log("r", "info", 0, "learner", str(index))
    assert [len(rows) for rows in store.transactions] == [4, 4, 2]
    assert [row[5] for rows in store.transactions for _, row in rows] == [str(i) for i in range(10)]


def test_the_interval_flushes_without_being_asked():
    store = RecordingStore()
    with BackgroundWriter(lambda: store, flush_interval_s=0.01) as writer:
        writer.write_log("r", "info", 0, "learner", "x")
        deadline = time.monotonic() + 5
        while not store.transactions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.transactions


def test_writes_never_wait_for_the_database():
    gate = threading.Event()
    store = RecordingStore(gate=gate)
    writer = BackgroundWriter(lambda: store, flush_interval_s=0)
    writer.write_log("r", "info", 0, "learner", "first")  # the thread now blocks in a transaction
    started = time.monotonic()
    for step in range(1000):
        writer.write_metrics("r", step, {"loss": 1.0})
    assert time.monotonic() - started < 1.0
    gate.set()
    writer.close()
    assert sum(len(rows) for rows in store.transactions) == 1001


def test_flush_waits_for_rows_queued_before_it(store_location):
    with open_store(store_location) as reader:
        reader.create_run("r", name="t", plan_sha256="x", plan_path="p", run_dir="d")
        with BackgroundWriter(lambda: open_store(store_location), flush_interval_s=SLOW) as writer:
            for index in range(50):
                writer.write_log("r", "info", 0, "learner", str(index))
            writer.write_metrics("r", 3, {"loss": 0.25})
            writer.flush()
            assert [r.message for r in reader.logs("r")] == [str(i) for i in range(50)]
            assert reader.latest_metrics("r")["loss"].value == 0.25


def test_close_writes_what_is_queued_and_is_idempotent():
    store = RecordingStore()
    writer = BackgroundWriter(lambda: store, flush_interval_s=SLOW)
    writer.write_log("r", "info", 0, "learner", "last words")
    writer.close()
    writer.close()
    writer.flush()  # nothing left to wait for
    assert store.transactions[0][0][1][5] == "last words"
    with pytest.raises(RuntimeError, match="closed"):
        writer.write_log("r", "info", 0, "learner", "too late")


def test_a_failed_write_is_raised_by_flush_and_close():
    store = RecordingStore(fail=OSError("disk full"))
    writer = BackgroundWriter(lambda: store, flush_interval_s=SLOW)
    writer.write_log("r", "info", 0, "learner", "x")
    with pytest.raises(WriterError, match="disk full") as info:
        writer.flush()
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(WriterError, match="disk full"):
        writer.close()
    with pytest.raises(WriterError):
        writer.close()  # still not lost on a second look
    assert store.closed


def test_a_store_that_cannot_open_is_raised():
    def cannot_open():
        raise PermissionError("read-only file system")

    writer = BackgroundWriter(cannot_open)
    with pytest.raises(WriterError, match="read-only file system"):
        writer.flush()
    with pytest.raises(WriterError):
        writer.close()


def test_a_real_integrity_error_surfaces(store_location):
    writer = BackgroundWriter(lambda: open_store(store_location), flush_interval_s=SLOW)
    writer.write_log("no-such-run", "info", 0, "learner", "x")
    with pytest.raises(WriterError, match=r"(?i)foreign key"):
        writer.close()


def test_bad_metric_values_fail_in_the_caller():
    with BackgroundWriter(RecordingStore) as writer, pytest.raises(ValueError):
        writer.write_metrics("r", 1, {"loss": "not a number"})


# --- the logging handler


@pytest.mark.parametrize(
    ("levelno", "expected"),
    [
        (logging.DEBUG, "debug"),
        (5, "debug"),
        (logging.INFO, "info"),
        (logging.WARNING, "warning"),
        (logging.ERROR, "error"),
        (logging.CRITICAL, "error"),
    ],
)
def test_store_level(levelno, expected):
    assert store_level(levelno) == expected


def test_log_handler_sends_formatted_records():
    store = RecordingStore()
    logger = logging.getLogger("rollout.test_writer")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    with BackgroundWriter(lambda: store, flush_interval_s=SLOW) as writer:
        handler = StoreLogHandler(writer, "r", rank=3, role="actor")
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
        try:
            logger.info("step %d done", 7)
            try:
                raise ValueError("boom")
            except ValueError:
                logger.exception("it failed")
        finally:
            logger.removeHandler(handler)
    rows = [row for _, row in store.transactions[0]]
    run_id, created, level, rank, role, message, span = rows[0]
    assert (run_id, level, rank, role, span) == ("r", "info", 3, "actor", None)
    assert message == "rollout.test_writer: step 7 done"
    assert abs(created - time.time()) < 60
    assert rows[1][2] == "error" and "ValueError: boom" in rows[1][5]


# --- metric sinks


class Sink:
    """Records what it is given; optionally fails, or logs while closing."""

    def __init__(self, name="sink", *, fail: Exception | None = None, logger=None):
        self.name = name
        self.batches: list[tuple] = []
        self.closed = 0
        self.fail = fail
        self.logger = logger

    def log(self, rows):
        self.batches.append(rows)
        if self.fail:
            raise self.fail

    def close(self):
        self.closed += 1
        if self.logger is not None:
            self.logger.warning("closing %s", self.name)


def test_sinks_get_each_transactions_metrics_after_the_store_and_are_closed():
    store = RecordingStore()
    sink = Sink()
    with BackgroundWriter(lambda: store, flush_interval_s=SLOW, sinks=[sink]) as writer:
        writer.write_metrics("r", 1, {"loss": 0.5, "reward": 1})
        writer.write_log("r", "info", 0, "learner", "not a metric")
        writer.flush()
        assert [(m.step, m.name, m.value) for m in sink.batches[0]] == [
            (1, "loss", 0.5),
            (1, "reward", 1.0),
        ]
        writer.write_log("r", "info", 0, "learner", "no metrics, no call")
        writer.flush()
        assert len(sink.batches) == 1 and sink.closed == 0
    assert sink.closed == 1


def test_a_failing_sink_is_dropped_with_a_warning_and_the_store_goes_on(caplog, monkeypatch):
    store = RecordingStore()
    broken, healthy = Sink("broken", fail=OSError("disk full")), Sink("healthy")
    # A worker turns propagation off; caplog listens at the root.
    monkeypatch.setattr(logging.getLogger("rollout"), "propagate", True)
    writer = BackgroundWriter(lambda: store, flush_interval_s=SLOW, sinks=[broken, healthy])
    with caplog.at_level(logging.WARNING, logger="rollout.storage.writer"), writer:
        for step in (1, 2):
            writer.write_metrics("r", step, {"loss": 1.0})
            writer.flush()
    assert len(broken.batches) == 1 and broken.closed == 1
    assert len(healthy.batches) == 2 and healthy.closed == 1
    assert len(store.transactions) == 2
    assert [r.getMessage() for r in caplog.records] == [
        "metric sink broken failed and is dropped: OSError('disk full')"
    ]


def test_what_a_sink_logs_while_closing_reaches_the_store():
    store = RecordingStore()
    logger = logging.getLogger("rollout.test_writer.sink")
    logger.propagate = False
    writer = BackgroundWriter(lambda: store, flush_interval_s=SLOW, sinks=[Sink(logger=logger)])
    logger.addHandler(StoreLogHandler(writer, "r", rank=0, role="learner"))
    try:
        writer.close()
    finally:
        logger.handlers.clear()
    messages = [row[5] for rows in store.transactions for kind, row in rows if kind == "log"]
    assert messages == ["closing sink"]
    with pytest.raises(RuntimeError, match="closed"):
        writer.write_log("r", "info", 0, "learner", "too late")


def test_sinks_are_closed_when_the_store_fails():
    sink = Sink()
    writer = BackgroundWriter(lambda: RecordingStore(fail=OSError("gone")), sinks=[sink])
    writer.write_metrics("r", 1, {"loss": 1.0})
    with pytest.raises(WriterError):
        writer.close()
    assert sink.batches == [] and sink.closed == 1  # rows the store lost never reach a sink
