"""Several processes share one run store at once, as torchrun workers and the host do, on
SQLite and on Postgres: no row lost, an empty store migrated once however many open it."""

from __future__ import annotations

import functools
import multiprocessing
import time

from rollout.storage import open_store
from rollout.storage.migrations import MIGRATIONS
from rollout.storage.writer import BackgroundWriter

PROCESSES = 4
LINES = 1000
RUN_ID = "concurrent"


def _worker(location: str, rank: int, start: multiprocessing.synchronize.Barrier) -> None:
    start.wait()  # all processes write at the same time, not one after another
    with BackgroundWriter(functools.partial(open_store, location), flush_interval_s=0.01) as writer:
        for index in range(LINES):
            writer.write_log(RUN_ID, "info", rank, "learner", f"{rank}:{index}")
            if index % 10 == 0:
                writer.write_metrics(RUN_ID, index, {f"rank{rank}/loss": 1.0 / (index + 1)})


def _run_processes(target, *args) -> None:
    context = multiprocessing.get_context("spawn")  # what torchrun gives: fresh interpreters
    start = context.Barrier(PROCESSES)
    processes = [
        context.Process(target=target, args=(*args, rank, start)) for rank in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    assert [process.exitcode for process in processes] == [0] * PROCESSES


def test_processes_write_concurrently_and_no_line_is_lost(store_location, tmp_path):
    with open_store(store_location) as store:
        store.create_run(RUN_ID, name="c", plan_sha256="x", plan_path="p", run_dir=str(tmp_path))

    started = time.perf_counter()
    _run_processes(_worker, store_location)
    elapsed = time.perf_counter() - started

    with open_store(store_location, create=False) as store:
        lines = store.logs(RUN_ID, limit=PROCESSES * LINES + 1)
        metrics = store.metrics(RUN_ID)
        run = store.get_run(RUN_ID)
    print(
        f"\n{store_location.split(':')[0]}: {PROCESSES} processes wrote {len(lines)} lines and "
        f"{len(metrics)} metric rows in {elapsed:.2f} s (interpreter start-up included)"
    )
    assert len(lines) == PROCESSES * LINES
    for rank in range(PROCESSES):
        mine = [line.message for line in lines if line.rank == rank]  # `lines` is in id order
        assert mine == [f"{rank}:{index}" for index in range(LINES)]
    assert len(metrics) == PROCESSES * LINES // 10
    assert run.last_step == LINES - 10


def _open(location: str, rank: int, start: multiprocessing.synchronize.Barrier) -> None:
    start.wait()
    open_store(location).close()


def test_processes_opening_an_empty_store_at_once_migrate_it_once(store_location):
    """Each migration number is a primary key of schema_version: a second migration of the
    same number would fail its process (and a table created twice would too)."""
    _run_processes(_open, store_location)
    with open_store(store_location, create=False) as store:
        rows = store._read(
            lambda: store._query("SELECT version FROM schema_version ORDER BY version")
        )
    assert [row["version"] for row in rows] == [m.number for m in MIGRATIONS]
