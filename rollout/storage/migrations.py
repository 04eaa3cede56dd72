"""The run store's schema, as numbered migrations (SQLite dialect).

A store records the numbers it has applied in `schema_version`; opening it applies the missing
ones, in order, in one transaction. Never edit a migration that has shipped: append a new one.
A Postgres backend keeps its own list with the same numbers and the same tables.
"""

from __future__ import annotations

Migration = tuple[int, str]

MIGRATIONS: list[Migration] = [
    (
        1,
        """
        CREATE TABLE runs (
            run_id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            status TEXT NOT NULL
                CHECK (status IN ('planned', 'running', 'stopped', 'failed', 'finished')),
            plan_sha256 TEXT NOT NULL,
            plan_path TEXT NOT NULL,
            run_dir TEXT NOT NULL,
            created_at REAL NOT NULL,
            started_at REAL,
            ended_at REAL,
            error TEXT,
            cancel_requested INTEGER NOT NULL DEFAULT 0,
            last_step INTEGER
        );
        CREATE INDEX runs_by_created ON runs (created_at);

        -- value is NULL for NaN: SQLite stores a NaN REAL as NULL, and a diverging loss must
        -- still be recorded rather than fail the writer.
        CREATE TABLE metrics (
            run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
            step INTEGER NOT NULL,
            name TEXT NOT NULL,
            value REAL,
            time REAL NOT NULL
        );
        CREATE INDEX metrics_by_run_name_step ON metrics (run_id, name, step);

        -- AUTOINCREMENT: ids never go back, so `logs tail --follow` can page by id.
        CREATE TABLE logs (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
            time REAL NOT NULL,
            level TEXT NOT NULL CHECK (level IN ('debug', 'info', 'warning', 'error')),
            rank INTEGER NOT NULL,
            role TEXT NOT NULL,
            message TEXT NOT NULL
        );
        CREATE INDEX logs_by_run_id ON logs (run_id, id);

        CREATE TABLE checkpoints (
            run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
            step INTEGER NOT NULL,
            location TEXT NOT NULL,
            time REAL NOT NULL,
            PRIMARY KEY (run_id, step)
        );
        """,
    ),
    (
        2,
        # Runs get an owner and a lease (one host owns a running run and renews its lease; a run
        # whose lease ran out is 'lost'), so the status CHECK grows a value. SQLite cannot alter a
        # CHECK: the table is rebuilt (the documented 12-step way; foreign keys are off while
        # migrations run, so dropping the old table cascades to nothing).
        # A resumed run redoes the steps after its checkpoint: one row per (run, metric, step),
        # the latest write winning, so its metrics are not stored twice.
        """
        CREATE TABLE runs_new (
            run_id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            status TEXT NOT NULL
                CHECK (status IN ('planned', 'running', 'stopped', 'failed', 'finished', 'lost')),
            plan_sha256 TEXT NOT NULL,
            plan_path TEXT NOT NULL,
            run_dir TEXT NOT NULL,
            created_at REAL NOT NULL,
            started_at REAL,
            ended_at REAL,
            error TEXT,
            cancel_requested INTEGER NOT NULL DEFAULT 0,
            last_step INTEGER,
            owner TEXT,
            lease_expires_at REAL
        );
        INSERT INTO runs_new (run_id, name, status, plan_sha256, plan_path, run_dir, created_at,
                              started_at, ended_at, error, cancel_requested, last_step)
            SELECT run_id, name, status, plan_sha256, plan_path, run_dir, created_at,
                   started_at, ended_at, error, cancel_requested, last_step FROM runs;
        DROP TABLE runs;
        ALTER TABLE runs_new RENAME TO runs;
        CREATE INDEX runs_by_created ON runs (created_at);
        CREATE INDEX runs_by_status ON runs (status);

        DELETE FROM metrics WHERE rowid NOT IN (
            SELECT MAX(rowid) FROM metrics GROUP BY run_id, name, step
        );
        DROP INDEX metrics_by_run_name_step;
        CREATE UNIQUE INDEX metrics_by_run_name_step ON metrics (run_id, name, step);
        """,
    ),
]
