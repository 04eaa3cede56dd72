"""The run store, on SQLite and on Postgres alike: CRUD, status times, filters, ordering,
ownership, migrations, locations. Tests of one backend's own settings say so in their name.
(Postgres's dropped connections: test_store_postgres.py.)"""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
import threading
import time

import pytest

from rollout.errors import RolloutError
from rollout.storage import check_run_id, default_store_location, find_run, open_store
from rollout.storage.base import CheckpointRecord, MetricRecord
from rollout.storage.migrations import MIGRATIONS
from rollout.storage.sqlite import SqliteRunStore
from tests.conftest import STORE_DSN_ENV

INTEGRITY_ERRORS: tuple[type[Exception], ...] = (sqlite3.IntegrityError,)
with contextlib.suppress(ImportError):
    import psycopg

    INTEGRITY_ERRORS += (psycopg.IntegrityError,)


@pytest.fixture
def store(store_location):
    with open_store(store_location) as the_store:
        yield the_store


def applied_versions(location):
    """The migration numbers the store at `location` records as applied."""
    with open_store(location, create=False) as store:
        rows = store._read(
            lambda: store._query("SELECT version FROM schema_version ORDER BY version")
        )
    return [row["version"] for row in rows]


def make_run(store, run_id="r1", **overrides):
    fields = {"name": "t", "plan_sha256": "ab" * 32, "plan_path": "/p/plan.lock", "run_dir": "/p"}
    return store.create_run(run_id, **{**fields, **overrides})


def log(run_id, level="info", rank=0, role="learner", message="m"):
    return (run_id, time.time(), level, rank, role, message)


# --- runs


def test_create_and_get_run(store):
    created = make_run(store)
    assert created.status == "planned" and not created.cancel_requested
    assert created.started_at is None and created.ended_at is None and created.last_step is None
    assert store.get_run("r1") == created
    assert store.get_run("nope") is None


def test_duplicate_run_id_is_a_user_error(store):
    make_run(store)
    with pytest.raises(RolloutError, match="already exists"):
        make_run(store)


def test_status_times(store):
    make_run(store)
    store.set_status("r1", "running")
    running = store.get_run("r1")
    assert running.started_at is not None and running.ended_at is None
    store.set_status("r1", "running")  # re-entering running keeps the clock
    assert store.get_run("r1").started_at == running.started_at
    store.set_status("r1", "failed", error="Traceback...\nValueError: x")
    failed = store.get_run("r1")
    assert failed.ended_at >= failed.started_at and failed.error.endswith("ValueError: x")


def test_resuming_starts_afresh(store):
    make_run(store)
    store.set_status("r1", "running")
    store.request_cancel("r1")
    store.set_status("r1", "stopped", error="stopped by user")
    store.set_status("r1", "running")
    resumed = store.get_run("r1")
    assert resumed.status == "running" and resumed.ended_at is None
    assert resumed.error is None and not resumed.cancel_requested


def test_unknown_status_and_unknown_run_are_refused(store):
    make_run(store)
    with pytest.raises(ValueError, match="unknown run status"):
        store.set_status("r1", "done")
    with pytest.raises(KeyError):
        store.set_status("nope", "running")
    with pytest.raises(KeyError):
        store.request_cancel("nope")


def test_request_cancel(store):
    make_run(store)
    store.set_status("r1", "running")
    store.request_cancel("r1")
    assert store.get_run("r1").cancel_requested


def test_list_runs_newest_first_with_status_filter_and_limit(store):
    for index in range(3):
        make_run(store, f"r{index}")
    store.set_status("r1", "running")
    assert [run.run_id for run in store.list_runs()] == ["r2", "r1", "r0"]
    assert [run.run_id for run in store.list_runs(status="running")] == ["r1"]
    assert [run.run_id for run in store.list_runs(limit=2)] == ["r2", "r1"]
    assert store.list_runs(status="failed") == []


# --- rows


def test_metrics_ordered_by_name_then_step_with_filter(store):
    make_run(store)
    now = time.time()
    store.add_metrics(
        MetricRecord("r1", step, name, float(step), now)
        for step in (2, 0, 1)
        for name in ("reward", "loss")
    )
    assert [(m.name, m.step) for m in store.metrics("r1")] == [
        ("loss", 0),
        ("loss", 1),
        ("loss", 2),
        ("reward", 0),
        ("reward", 1),
        ("reward", 2),
    ]
    assert {m.name for m in store.metrics("r1", names=["loss"])} == {"loss"}
    assert store.metrics("r1", names=[]) == []


def test_latest_metrics_and_last_step(store):
    make_run(store)
    now = time.time()
    store.add_metrics(
        [MetricRecord("r1", 5, "loss", 0.5, now), MetricRecord("r1", 7, "kl", 1, now)]
    )
    store.add_metrics([MetricRecord("r1", 3, "loss", 0.9, now)])  # late, lower step
    latest = store.latest_metrics("r1")
    assert {name: (m.step, m.value) for name, m in latest.items()} == {
        "kl": (7, 1.0),
        "loss": (5, 0.5),
    }
    assert store.get_run("r1").last_step == 7


def test_nan_metric_is_kept(store):
    make_run(store)
    store.add_metrics([MetricRecord("r1", 1, "loss", math.nan, time.time())])
    assert math.isnan(store.latest_metrics("r1")["loss"].value)


def test_rows_for_an_unknown_run_are_refused(store):
    with pytest.raises(INTEGRITY_ERRORS):
        store.add_logs([log("ghost")])


def test_logs_filters_and_paging(store):
    make_run(store)
    store.add_logs(
        [
            log("r1", "debug", 0, "actor", "a"),
            log("r1", "info", 1, "learner", "b"),
            log("r1", "warning", 0, "actor+learner", "c"),
            log("r1", "error", 1, "actor", "d"),
        ]
    )
    messages = lambda **kw: [r.message for r in store.logs("r1", **kw)]  # noqa: E731
    assert messages() == ["a", "b", "c", "d"]
    assert messages(level="warning") == ["c", "d"]
    assert messages(rank=1) == ["b", "d"]
    assert messages(role="learner") == ["b", "c"]  # a colocated process counts for each role
    assert messages(role="earn") == []
    assert messages(limit=2) == ["a", "b"]
    first_two = store.logs("r1", limit=2)
    assert messages(after_id=first_two[-1].id) == ["c", "d"]
    assert messages(newest_first=True, limit=3) == ["d", "c", "b"]


def test_checkpoints_ordered_and_replaced_at_the_same_step(store):
    make_run(store)
    store.add_checkpoint(CheckpointRecord("r1", 20, "/c/20", 1.0))
    store.add_checkpoint(CheckpointRecord("r1", 10, "/c/10", 2.0))
    store.add_checkpoint(CheckpointRecord("r1", 20, "/c/20b", 3.0))
    assert [(c.step, c.location) for c in store.checkpoints("r1")] == [
        (10, "/c/10"),
        (20, "/c/20b"),
    ]


def test_transaction_is_all_or_nothing(store):
    make_run(store)
    with pytest.raises(INTEGRITY_ERRORS), store.transaction():
        store.add_logs([log("r1")])
        store.add_logs([log("ghost")])
    assert store.logs("r1") == []


# --- schema and connection


def test_migrations_are_numbered_in_order_in_both_dialects():
    assert [m.number for m in MIGRATIONS] == list(range(1, len(MIGRATIONS) + 1))
    assert all(m.sqlite.strip() and m.postgres.strip() for m in MIGRATIONS)


def test_reopening_is_idempotent(store_location):
    for _ in range(3):
        with open_store(store_location) as store:
            make_run(store, f"r{time.monotonic_ns()}")
    assert applied_versions(store_location) == [m.number for m in MIGRATIONS]


def test_concurrent_open_of_a_fresh_store(store_location):
    """Threads stand in for processes here (each has its own connection); the integration test
    does it with processes."""
    barrier = threading.Barrier(6)
    errors = []

    def open_once():
        barrier.wait()
        try:
            open_store(store_location).close()
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=open_once) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert applied_versions(store_location) == [m.number for m in MIGRATIONS]


def test_sqlite_connection_settings(tmp_path):
    store = SqliteRunStore(tmp_path / "rollout.db")
    pragma = lambda name: store._conn.execute(f"PRAGMA {name}").fetchone()[0]  # noqa: E731
    assert pragma("journal_mode") == "wal"
    assert pragma("foreign_keys") == 1
    assert pragma("synchronous") == 1  # NORMAL
    assert pragma("busy_timeout") == 30_000
    store.close()


def test_a_newer_schema_is_refused(store_location):
    with open_store(store_location) as store:
        store._write(lambda: store._execute("INSERT INTO schema_version VALUES (999, 0)"))
    with pytest.raises(RolloutError, match="newer than this rollout knows"):
        open_store(store_location)


# --- locations and lookups


def test_open_store_creates_parent_directories(tmp_path):
    path = tmp_path / "a" / "b" / "rollout.db"
    open_store(f"sqlite:{path}").close()
    assert path.is_file()


def test_reading_a_missing_store_never_creates_it(tmp_path):
    path = tmp_path / "missing" / "rollout.db"
    with pytest.raises(RolloutError, match="no run store here") as info:
        open_store(f"sqlite:{path}", create=False)
    assert info.value.issues[0].path == str(path)
    assert not path.parent.exists()


def test_a_file_that_is_not_a_database(tmp_path):
    path = tmp_path / "rollout.db"
    path.write_text("hello, this is not sqlite" * 100)
    with pytest.raises(RolloutError, match="cannot open the run store"):
        open_store(f"sqlite:{path}", create=False)


@pytest.mark.parametrize(
    ("location", "message"),
    [
        ("postgresql://user:secret@host/db", "is named postgres:env:NAME or postgres:file:"),
        ("postgres://user:secret@host/db", "a reference to its DSN, never the DSN itself"),
        ("postgres:host=h password=secret", "a reference to its DSN, never the DSN itself"),
        ("postgresql:env:ROLLOUT_PG_DSN", "is named postgres:env:NAME"),
        ("mysql://user:secret@host/db", "unknown run store scheme 'mysql'"),
        ("runs/rollout.db", "is not a run store location"),
        ("sqlite:", "is not a run store location"),
    ],
)
def test_bad_locations(location, message):
    with pytest.raises(RolloutError, match=message) as info:
        open_store(location)
    assert "secret" not in str(info.value)


def test_default_store_location(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ROLLOUT_STORE", raising=False)
    assert default_store_location() == f"sqlite:{tmp_path.resolve() / 'runs' / 'rollout.db'}"
    monkeypatch.setenv("ROLLOUT_STORE", "sqlite:/elsewhere.db")
    assert default_store_location() == "sqlite:/elsewhere.db"


@pytest.mark.parametrize("run_id", ["../r1", "a/b", "a\\b", "a b", "r1\n", ""])
def test_path_like_run_ids_are_refused(run_id):
    with pytest.raises(RolloutError, match="a run id has no"):
        check_run_id(run_id)


def test_find_run_suggests_close_ids(store):
    make_run(store, "grpo-tiny-20260101-000000-abc123")
    assert find_run(store, "grpo-tiny-20260101-000000-abc123", "here").name == "t"
    with pytest.raises(
        RolloutError, match="no run 'grpo-tiny-20260101-000000-abc12' in here"
    ) as info:
        find_run(store, "grpo-tiny-20260101-000000-abc12", "here")
    assert info.value.issues[0].hint == "did you mean 'grpo-tiny-20260101-000000-abc123'?"


# --- ownership: claims, leases, lost runs


def test_a_claim_makes_a_fresh_start_and_a_live_lease_refuses_a_second_owner(store):
    make_run(store)
    store.request_cancel("r1")  # left over from an earlier attempt: must not stop this one
    assert store.claim_run("r1", "A", lease_s=60) is None
    run = store.get_run("r1")
    assert run.status == "running" and run.owner == "A" and not run.cancel_requested
    assert run.lease_expires_at > time.time() + 50
    assert store.claim_run("r1", "B", lease_s=60) == "A"  # refused, nothing changed
    assert store.get_run("r1").owner == "A"
    assert store.claim_run("r1", "A", lease_s=60) is None  # the owner may claim again


def test_only_the_owner_renews_and_ends_a_run(store):
    make_run(store)
    store.claim_run("r1", "A", lease_s=60)
    assert not store.renew_lease("r1", "B", lease_s=60)
    assert store.renew_lease("r1", "A", lease_s=600)
    assert store.get_run("r1").lease_expires_at > time.time() + 500
    assert not store.end_run("r1", "B", "finished")
    assert store.end_run("r1", "A", "stopped")
    run = store.get_run("r1")
    assert run.status == "stopped" and run.owner is None and run.lease_expires_at is None
    assert run.ended_at is not None
    with pytest.raises(ValueError, match="not a final status"):
        store.end_run("r1", "A", "running")


def test_an_expired_lease_makes_the_run_lost_and_free_to_claim(store):
    for run_id in ("expired", "live"):
        make_run(store, run_id)
    store.claim_run("expired", "A", lease_s=60)
    store.claim_run("live", "B", lease_s=600)
    assert store.expire_leases(now=time.time() + 120) == ["expired"]
    lost = store.get_run("expired")
    assert lost.status == "lost" and "lease" in lost.error and lost.owner is None
    assert store.get_run("live").status == "running"
    assert not store.renew_lease("expired", "A", lease_s=60)  # A learns it lost the run
    assert store.claim_run("expired", "C", lease_s=60) is None  # a resume takes it over
    assert store.get_run("expired").error is None


def test_a_running_run_without_a_lease_is_lost(store):
    """Rows from before leases existed (or set running by hand) are never running forever."""
    make_run(store)
    store.set_status("r1", "running")
    assert store.expire_leases() == ["r1"]


def test_mark_lost_needs_the_dead_owner(store):
    make_run(store)
    store.claim_run("r1", "A", lease_s=60)
    assert not store.mark_lost("r1", "B", error="x")
    assert store.mark_lost("r1", "A", error="owner died")
    assert store.get_run("r1").status == "lost"


def test_two_connections_claiming_at_once_give_one_owner(store_location):
    with open_store(store_location) as store:
        make_run(store)
    winners = []
    start = threading.Barrier(8)

    def claim(name):
        with open_store(store_location) as mine:
            start.wait()
            if mine.claim_run("r1", name, lease_s=60) is None:
                winners.append(name)

    threads = [threading.Thread(target=claim, args=(f"owner-{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(winners) == 1


def test_a_redone_step_keeps_one_row_per_metric(store):
    make_run(store)
    store.add_metrics([MetricRecord("r1", 3, "loss", 1.0, 1.0)])
    store.add_metrics([MetricRecord("r1", 3, "loss", 0.5, 2.0)])  # the step, redone on resume
    assert [(m.step, m.value) for m in store.metrics("r1")] == [(3, 0.5)]


def test_a_metric_written_twice_in_one_batch_keeps_the_last_value(store):
    make_run(store)
    # Integer and float values mixed in one batch, as loops write them (a count, a loss).
    store.add_metrics(
        [
            MetricRecord("r1", 3, "loss", 1, 1.0),
            MetricRecord("r1", 3, "tokens", 12, 1.0),
            MetricRecord("r1", 3, "loss", 0.25, 2.0),
        ]
    )
    assert [(m.name, m.step, m.value) for m in store.metrics("r1")] == [
        ("loss", 3, 0.25),
        ("tokens", 3, 12.0),
    ]


def test_migrating_a_version_1_sqlite_store_keeps_its_rows(tmp_path):
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at REAL)")
    for statement in MIGRATIONS[0].sqlite.split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.execute("INSERT INTO schema_version VALUES (1, 0)")
    conn.execute(
        "INSERT INTO runs (run_id, name, status, plan_sha256, plan_path, run_dir, created_at) "
        "VALUES ('old', 't', 'finished', 'x', 'p', 'd', 1)"
    )
    rows = [("old", 1, "loss", 2.0, 1.0), ("old", 1, "loss", 1.0, 2.0), ("old", 2, "loss", 0.5, 3)]
    conn.executemany("INSERT INTO metrics VALUES (?, ?, ?, ?, ?)", rows)
    conn.execute(
        "INSERT INTO logs (run_id, time, level, rank, role, message) "
        "VALUES ('old', 1, 'info', 0, 'learner', 'hello')"
    )
    conn.commit()
    conn.close()
    with SqliteRunStore(path) as store:
        assert store.get_run("old").status == "finished"
        # the duplicated step kept its last row; logs still belong to their run
        assert [(m.step, m.value) for m in store.metrics("old")] == [(1, 1.0), (2, 0.5)]
        assert [line.message for line in store.logs("old")] == ["hello"]
        assert store._conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        assert store._conn.execute("PRAGMA foreign_key_check").fetchall() == []


def test_migrating_a_version_1_postgres_store_keeps_its_rows(postgres_location):
    dsn = os.environ[STORE_DSN_ENV]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION)"
        )
        conn.execute(MIGRATIONS[0].postgres)
        conn.execute("INSERT INTO schema_version VALUES (1, 0)")
        conn.execute(
            "INSERT INTO runs (run_id, name, status, plan_sha256, plan_path, run_dir, created_at) "
            "VALUES ('old', 't', 'finished', 'x', 'p', 'd', 1)"
        )
        rows = [
            ("old", 1, "loss", 2.0, 1.0),
            ("old", 1, "loss", 1.0, 2.0),
            ("old", 2, "loss", 0.5, 3),
        ]
        conn.cursor().executemany("INSERT INTO metrics VALUES (%s, %s, %s, %s, %s)", rows)
    with open_store(postgres_location) as store:
        assert store.get_run("old").status == "finished"
        assert [(m.step, m.value) for m in store.metrics("old")] == [(1, 1.0), (2, 0.5)]
        store.claim_run("old", "A", lease_s=60)  # the lease columns and 'lost' came with v2
        assert store.expire_leases(now=time.time() + 120) == ["old"]
    assert applied_versions(postgres_location) == [m.number for m in MIGRATIONS]
