"""Several processes write to one SQLite run store at once, as torchrun workers do: no row lost."""

from __future__ import annotations

import functools
import multiprocessing

from rollout.storage import open_store
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


def test_processes_write_concurrently_and_no_line_is_lost(tmp_path):
    location = f"sqlite:{tmp_path / 'rollout.db'}"
    with open_store(location) as store:
        store.create_run(RUN_ID, name="c", plan_sha256="x", plan_path="p", run_dir=str(tmp_path))

    context = multiprocessing.get_context("spawn")  # what torchrun gives: fresh interpreters
    start = context.Barrier(PROCESSES)
    processes = [
        context.Process(target=_worker, args=(location, rank, start)) for rank in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=60)
    assert [process.exitcode for process in processes] == [0] * PROCESSES

    with open_store(location, create=False) as store:
        lines = store.logs(RUN_ID, limit=PROCESSES * LINES + 1)
        metrics = store.metrics(RUN_ID)
        run = store.get_run(RUN_ID)
    assert len(lines) == PROCESSES * LINES
    for rank in range(PROCESSES):
        mine = [line.message for line in lines if line.rank == rank]  # `lines` is in id order
        assert mine == [f"{rank}:{index}" for index in range(LINES)]
    assert len(metrics) == PROCESSES * LINES // 10
    assert run.last_step == LINES - 10
