"""The Postgres run store's own behaviour, against a real server: a connection dropped at any
moment (the backend ended with pg_terminate_backend) is reconnected and the write done exactly
once; log ids rise in commit order across writers; what the DSN holds never reaches a message.

Everything the two backends share is tested on both in test_store.py.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from rollout.errors import RolloutError
from rollout.storage import open_store
from rollout.storage.base import CheckpointRecord, MetricRecord
from rollout.storage.writer import BackgroundWriter
from tests.conftest import STORE_DSN_ENV

psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed")

LINES = 1000


@pytest.fixture
def store(postgres_location):
    with open_store(postgres_location) as the_store:
        the_store.create_run("r1", name="t", plan_sha256="x", plan_path="p", run_dir="d")
        yield the_store


@pytest.fixture
def admin(postgres_server):
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        yield conn


def terminate(admin, *pids):
    for pid in pids:
        assert admin.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone()[0]


def drop_after_commit(store, monkeypatch):
    """Make the store's connection commit, then drop before the answer reaches the store."""
    connection = store._conn
    commit = connection.commit

    def commit_then_drop():
        commit()
        connection.close()
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(connection, "commit", commit_then_drop)
    return connection


def lines(store, run_id="r1"):
    return [line.message for line in store.logs(run_id, limit=100_000)]


def test_a_dropped_connection_is_reconnected_for_the_next_write_and_read(store, admin):
    old = store.backend_pid
    terminate(admin, old)
    store.add_logs([("r1", 1.0, "info", 0, "learner", "after the drop")])
    assert store.backend_pid != old
    terminate(admin, store.backend_pid)
    assert lines(store) == ["after the drop"]  # a read reconnects too
    terminate(admin, store.backend_pid)
    assert store.claim_run("r1", "A", lease_s=60) is None
    assert store.get_run("r1").owner == "A"


def test_a_connection_dropped_inside_a_transaction_writes_the_whole_batch_once(store, admin):
    with store.transaction():
        store.add_metrics([MetricRecord("r1", 1, "loss", 0.5, 1.0)])
        store.add_logs([("r1", 1.0, "info", 0, "learner", "one")])
        terminate(admin, store.backend_pid)  # the statements above are lost with it
        store.add_logs([("r1", 2.0, "info", 0, "learner", "two")])
        store.add_checkpoint(CheckpointRecord("r1", 1, "/c/1", 2.0))
    assert lines(store) == ["one", "two"]
    assert [(m.step, m.value) for m in store.metrics("r1")] == [(1, 0.5)]
    assert [c.location for c in store.checkpoints("r1")] == ["/c/1"]
    assert store.get_run("r1").last_step == 1


def test_a_commit_whose_answer_was_lost_is_not_written_twice(store, monkeypatch):
    """The COMMIT reached the server and committed, then the connection dropped before the
    answer came back: the store cannot tell, writes the batch again, and nothing doubles."""
    connection = drop_after_commit(store, monkeypatch)
    with store.transaction():
        store.add_metrics([MetricRecord("r1", 1, "loss", 0.5, 1.0)])
        store.add_logs([("r1", 1.0, "info", 0, "learner", f"line {i}") for i in range(3)])
        store.add_checkpoint(CheckpointRecord("r1", 1, "/c/1", 2.0))
    assert store._conn is not connection  # it did connect again
    assert lines(store) == ["line 0", "line 1", "line 2"]
    assert len(store.metrics("r1")) == 1 and len(store.checkpoints("r1")) == 1


def test_a_run_created_by_a_commit_whose_answer_was_lost_is_not_a_duplicate(
    postgres_location, monkeypatch
):
    with open_store(postgres_location) as store:
        drop_after_commit(store, monkeypatch)
        created = store.create_run("r2", name="t", plan_sha256="x", plan_path="p", run_dir="d")
        assert store.get_run("r2") == created
        with pytest.raises(RolloutError, match="already exists"):  # a real second one still is
            store.create_run("r2", name="t", plan_sha256="x", plan_path="p", run_dir="d")


def test_the_writer_loses_and_doubles_nothing_while_its_connections_are_killed(
    postgres_location, admin, monkeypatch
):
    with open_store(postgres_location) as reader:
        reader.create_run("r1", name="t", plan_sha256="x", plan_path="p", run_dir="d")
    name = f"rollout-kill-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv(STORE_DSN_ENV, f"{os.environ[STORE_DSN_ENV]} application_name={name}")
    stop = threading.Event()
    killed = []

    def killer():
        while not stop.is_set():
            rows = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                [name],
            ).fetchall()
            killed.extend(row[0] for row in rows if row[0])
            time.sleep(0.05)

    thread = threading.Thread(target=killer)
    try:
        with BackgroundWriter(
            lambda: open_store(postgres_location), flush_interval_s=0.005, max_batch=20
        ) as writer:
            writer.flush()  # its store is open: from here on every drop must be survived
            thread.start()
            for index in range(LINES):
                writer.write_log("r1", "info", 0, "learner", str(index))
                if index % 10 == 0:
                    writer.write_metrics("r1", index, {"loss": 1.0 / (index + 1)})
                if index % 50 == 0:
                    time.sleep(0.02)  # let the killer in between batches, and during them
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
    with open_store(postgres_location) as reader:
        assert lines(reader) == [str(index) for index in range(LINES)]
        assert [m.step for m in reader.metrics("r1")] == list(range(0, LINES, 10))
        assert reader.get_run("r1").last_step == LINES - 10
    print(f"{len(killed)} connections killed while writing {LINES} lines")
    assert len(killed) >= 5, f"the killer ended only {len(killed)} connections"


def test_a_server_that_stays_away_fails_the_write_with_a_clear_error(store, admin):
    store.reconnect_s = 0.3
    store._dsn = "host=127.0.0.1 port=9 dbname=test user=postgres password=hunter2"
    terminate(admin, store.backend_pid)
    with pytest.raises(RolloutError, match=r"could not write again within 0\.3 s") as caught:
        store.add_logs([("r1", 1.0, "info", 0, "learner", "x")])
    assert "hunter2" not in str(caught.value)


def test_log_ids_rise_in_commit_order_across_writers(postgres_location):
    """A writer that took its ids first but commits last would be skipped by `logs tail
    --follow`, which pages by id: a run's writers take turns instead."""
    with open_store(postgres_location) as first, open_store(postgres_location) as second:
        first.create_run("r1", name="t", plan_sha256="x", plan_path="p", run_dir="d")
        done = threading.Event()

        def write_second():
            second.add_logs([("r1", 2.0, "info", 1, "learner", "second")])
            done.set()

        with first.transaction():
            first.add_logs([("r1", 1.0, "info", 0, "learner", "first")])
            thread = threading.Thread(target=write_second)
            thread.start()
            assert not done.wait(0.3)  # waits for the first writer's commit
        thread.join()
        assert lines(first) == ["first", "second"]  # in id order


def test_an_unparsable_dsn_is_refused_without_echoing_it(monkeypatch):
    monkeypatch.setenv("BAD_DSN", "host=h password=hunter2 nonsense")
    with pytest.raises(RolloutError, match="not a libpq connection string") as caught:
        open_store("postgres:env:BAD_DSN")
    assert "hunter2" not in str(caught.value)


def test_a_dsn_from_a_file(postgres_location, tmp_path):
    path = tmp_path / "dsn"
    path.write_text(os.environ[STORE_DSN_ENV] + "\n")
    with open_store(f"postgres:file:{path}") as store:
        store.create_run("r1", name="t", plan_sha256="x", plan_path="p", run_dir="d")
    with open_store(postgres_location, create=False) as store:
        assert store.get_run("r1") is not None
