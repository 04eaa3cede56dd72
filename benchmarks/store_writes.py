"""Run-store write throughput, SQLite against Postgres, through the background writer workers use.

One process queues `--rows` metric rows (and as many log lines) and waits for them to be written;
rows per second is rows / that time. Backends alternate, `--repeats` times each, in one process,
and the median is reported (these machines are noisy: compare the two columns, not across runs).

    python benchmarks/store_writes.py                      # Postgres at 127.0.0.1:5432, db test
    python benchmarks/store_writes.py --dsn 'host=db dbname=bench user=me' --rows 50000

`--writers 8` measures what a multi-process run does instead: 8 processes (the workers of one
run), each with its own background writer, each writing `--rate` records a second (half metric
rows, half log lines) for `--seconds`, paced as a training loop would. It reports the records per
second the store took in, how far behind the slowest writer finished (its flush after its last
record), and counts the stored rows: any record lost or written twice is reported.

The Postgres side writes into a schema of its own, dropped at the end.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import psycopg
from psycopg import conninfo, sql

from rollout.storage import open_store
from rollout.storage.writer import BackgroundWriter

DSN_ENV = "ROLLOUT_BENCH_PG_DSN"


def write_rows(location: str, rows: int, kind: str) -> float:
    """Seconds to queue and write `rows` rows of `kind` (metrics or logs) into a fresh run."""
    run_id = f"bench-{secrets.token_hex(4)}"
    with open_store(location) as store:
        store.create_run(run_id, name="bench", plan_sha256="x", plan_path="p", run_dir="d")
    started = time.perf_counter()
    with BackgroundWriter(lambda: open_store(location)) as writer:
        for index in range(rows):
            if kind == "metrics":
                writer.write_metrics(run_id, index // 8, {f"metric/{index % 8}": index / rows})
            else:
                writer.write_log(run_id, "info", 0, "learner", f"line {index}")
    return time.perf_counter() - started


def paced_writer(
    location: str, run_id: str, rank: int, rate: int, seconds: float
) -> tuple[float, float, float]:
    """Write `rate` records a second for `seconds` as worker `rank`. Returns when it started and
    ended (wall-clock seconds: the writers are separate processes) and its flush lag: the
    seconds between queueing its last record and all of them being stored."""
    records = int(rate * seconds)
    with BackgroundWriter(lambda: open_store(location)) as writer:
        started = time.perf_counter()
        started_at = time.time()
        for index in range(records):
            due = started + index / rate
            if (wait := due - time.perf_counter()) > 0:
                time.sleep(wait)
            if index % 2:
                writer.write_log(run_id, "info", rank, "learner", f"rank {rank} line {index}")
            else:
                writer.write_metrics(run_id, index // 2, {f"rank{rank}/value": float(index)})
        last_queued = time.perf_counter()
        writer.flush()
        return started_at, time.time(), time.perf_counter() - last_queued


def many_writers(location: str, writers: int, rate: int, seconds: float) -> str:
    run_id = f"bench-{secrets.token_hex(4)}"
    with open_store(location) as store:
        store.create_run(run_id, name="bench", plan_sha256="x", plan_path="p", run_dir="d")
    # spawn: each writer is a fresh interpreter, as a run's workers are.
    context = multiprocessing.get_context("spawn")
    with context.Pool(writers) as pool:
        timings = pool.starmap(
            paced_writer, [(location, run_id, rank, rate, seconds) for rank in range(writers)]
        )
    # From the first record queued to the last one stored, process start-up left out.
    wall = max(end for _, end, _ in timings) - min(start for start, _, _ in timings)
    lags = [lag for _, _, lag in timings]
    expected_metrics = writers * ((int(rate * seconds) + 1) // 2)
    expected_logs = writers * (int(rate * seconds) // 2)
    with open_store(location) as store:
        metrics = len(store.metrics(run_id))
        logs = len(store.logs(run_id, limit=10**9))
    stored = metrics + logs
    lost = expected_metrics + expected_logs - stored
    return (
        f"{writers} writers x {rate:,} records/s for {seconds:g} s: {stored:,} records stored in "
        f"{wall:.2f} s ({stored / wall:,.0f} records/s), slowest "
        f"flush lag {max(lags):.2f} s, metrics {metrics:,}/{expected_metrics:,}, "
        f"logs {logs:,}/{expected_logs:,}" + (f", {lost:+,} MISSING" if lost else ", none lost")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default="host=127.0.0.1 port=5432 dbname=test user=postgres")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--writers", type=int, default=0, help="processes; 0: one, unpaced")
    parser.add_argument("--rate", type=int, default=1_000, help="records/s per writer")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()

    schema = f"rollout_bench_{secrets.token_hex(4)}"
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    os.environ[DSN_ENV] = conninfo.make_conninfo(args.dsn, options=f"-csearch_path={schema}")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            locations = {
                "sqlite": f"sqlite:{Path(tmp) / 'rollout.db'}",
                "postgres": f"postgres:env:{DSN_ENV}",
            }
            if args.writers:
                for name, location in locations.items():
                    print(
                        f"{name:8} " + many_writers(location, args.writers, args.rate, args.seconds)
                    )
                return
            for kind in ("metrics", "logs"):
                seconds: dict[str, list[float]] = {name: [] for name in locations}
                for _ in range(args.repeats):
                    for name, location in locations.items():
                        seconds[name].append(write_rows(location, args.rows, kind))
                rates = {name: args.rows / statistics.median(s) for name, s in seconds.items()}
                print(
                    f"{kind:8} {args.rows} rows, median of {args.repeats}: "
                    + ", ".join(f"{name} {rate:,.0f} rows/s" for name, rate in rates.items())
                    + f" (postgres / sqlite {rates['postgres'] / rates['sqlite']:.2f}x)"
                )
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


if __name__ == "__main__":
    main()
