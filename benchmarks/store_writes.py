"""Run-store write throughput, SQLite against Postgres, through the background writer workers use.

One process queues `--rows` metric rows (and as many log lines) and waits for them to be written;
rows per second is rows / that time. Backends alternate, `--repeats` times each, in one process,
and the median is reported (these machines are noisy: compare the two columns, not across runs).

    python benchmarks/store_writes.py                      # Postgres at 127.0.0.1:5432, db test
    python benchmarks/store_writes.py --dsn 'host=db dbname=bench user=me' --rows 50000

The Postgres side writes into a schema of its own, dropped at the end.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default="host=127.0.0.1 port=5432 dbname=test user=postgres")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
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
