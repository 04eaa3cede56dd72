"""The run store's schema, as numbered migrations: each number once, in both dialects.

A store records the numbers it has applied in `schema_version`; opening it applies the missing
ones, in order, in one transaction. Never edit a migration that has shipped: append a new one.
SQLite and Postgres get the same tables, columns and indexes at every number; only the dialect
differs (REAL / DOUBLE PRECISION, AUTOINCREMENT / IDENTITY, SQLite rebuilding a table where
Postgres alters it).
"""

from __future__ import annotations

from typing import NamedTuple

from rollout.errors import Issue, RolloutError


class Migration(NamedTuple):
    number: int
    sqlite: str
    postgres: str


MIGRATIONS: list[Migration] = [
    Migration(
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
        """
        CREATE TABLE runs (
            run_id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            status TEXT NOT NULL CONSTRAINT runs_status_check
                CHECK (status IN ('planned', 'running', 'stopped', 'failed', 'finished')),
            plan_sha256 TEXT NOT NULL,
            plan_path TEXT NOT NULL,
            run_dir TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            started_at DOUBLE PRECISION,
            ended_at DOUBLE PRECISION,
            error TEXT,
            cancel_requested INTEGER NOT NULL DEFAULT 0,
            last_step BIGINT
        );
        CREATE INDEX runs_by_created ON runs (created_at);

        -- A NaN value is stored as NaN (Postgres keeps it; SQLite turns it into NULL).
        CREATE TABLE metrics (
            run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
            step BIGINT NOT NULL,
            name TEXT NOT NULL,
            value DOUBLE PRECISION,
            time DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX metrics_by_run_name_step ON metrics (run_id, name, step);

        -- Ids never go back; writers of one run take turns (an advisory lock) so that a run's
        -- ids are also in commit order, and `logs tail --follow` can page by id.
        CREATE TABLE logs (
            id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
            time DOUBLE PRECISION NOT NULL,
            level TEXT NOT NULL CHECK (level IN ('debug', 'info', 'warning', 'error')),
            rank INTEGER NOT NULL,
            role TEXT NOT NULL,
            message TEXT NOT NULL
        );
        CREATE INDEX logs_by_run_id ON logs (run_id, id);

        CREATE TABLE checkpoints (
            run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
            step BIGINT NOT NULL,
            location TEXT NOT NULL,
            time DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (run_id, step)
        );
        """,
    ),
    Migration(
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
        """
        ALTER TABLE runs ADD COLUMN owner TEXT, ADD COLUMN lease_expires_at DOUBLE PRECISION;
        ALTER TABLE runs DROP CONSTRAINT runs_status_check;
        ALTER TABLE runs ADD CONSTRAINT runs_status_check
            CHECK (status IN ('planned', 'running', 'stopped', 'failed', 'finished', 'lost'));
        CREATE INDEX runs_by_status ON runs (status);

        DELETE FROM metrics AS older USING metrics AS newer
            WHERE older.run_id = newer.run_id AND older.name = newer.name
              AND older.step = newer.step AND (older.time, older.ctid) < (newer.time, newer.ctid);
        DROP INDEX metrics_by_run_name_step;
        CREATE UNIQUE INDEX metrics_by_run_name_step ON metrics (run_id, name, step);
        """,
    ),
    Migration(
        3,
        # A log line may carry a key chosen by its writer. A Postgres writer whose connection
        # dropped during a commit cannot know whether the commit happened, so it writes the
        # batch again: a line whose key is already there is not added twice. (SQLite writers
        # never retry, and leave it NULL; NULLs never collide.)
        """
        ALTER TABLE logs ADD COLUMN write_key TEXT;
        CREATE UNIQUE INDEX logs_by_write_key ON logs (write_key);
        """,
        """
        ALTER TABLE logs ADD COLUMN write_key TEXT;
        CREATE UNIQUE INDEX logs_by_write_key ON logs (write_key);
        """,
    ),
    Migration(
        4,
        # Sample completions recorded during training (logging.samples_per_step), for run
        # reports' trajectory viewer. One row per (run, step, index), the latest write winning
        # (a resumed run redoes steps). A single-turn sample has a completion; a multi-turn
        # episode has its turns as JSON ([{"role", "content"}, ...]) instead. JSON is kept as
        # text in both dialects, so both read back the same strings.
        """
        CREATE TABLE samples (
            run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
            step INTEGER NOT NULL,
            sample_index INTEGER NOT NULL,
            prompt TEXT NOT NULL,
            completion TEXT,
            turns TEXT,
            reward REAL,
            extra TEXT NOT NULL,
            time REAL NOT NULL,
            PRIMARY KEY (run_id, step, sample_index)
        );
        """,
        """
        CREATE TABLE samples (
            run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
            step BIGINT NOT NULL,
            sample_index INTEGER NOT NULL,
            prompt TEXT NOT NULL,
            completion TEXT,
            turns TEXT,
            reward DOUBLE PRECISION,
            extra TEXT NOT NULL,
            time DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (run_id, step, sample_index)
        );
        """,
    ),
]

LATEST = MIGRATIONS[-1].number


def pending(current: int) -> list[Migration]:
    """What a store at schema version `current` lacks, in order; a RolloutError for a store that
    a newer rollout migrated (this one would misread it)."""
    if current > LATEST:
        raise RolloutError(
            Issue(
                "run store",
                f"schema version {current} is newer than this rollout knows ({LATEST})",
                hint="upgrade rollout to read this store",
            )
        )
    return [migration for migration in MIGRATIONS if migration.number > current]
