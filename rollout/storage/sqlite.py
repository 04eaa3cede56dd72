"""The SQLite run store: one file on one machine, the embedded default.

One `SqliteRunStore` holds one connection, usable only from the thread that opened it (sqlite3
checks this): open one store object per process and thread. The background writer opens its own
inside its thread.

The connection settings are what lets several processes share the file: WAL lets readers
(`rollout logs tail`) read while workers write; a 30 s busy timeout makes concurrent writers queue
instead of failing; synchronous=NORMAL survives a process crash and loses at most the last
transactions on power loss, which is an acceptable price for logs and metrics.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import sqlite_utils

from rollout.errors import Issue, RolloutError
from rollout.storage.base import (
    FINAL_STATUSES,
    LOG_LEVELS,
    RUN_STATUSES,
    CheckpointRecord,
    LogLevel,
    LogRecord,
    LogRow,
    MetricRecord,
    RunRecord,
    RunStatus,
)
from rollout.storage.migrations import MIGRATIONS

BUSY_TIMEOUT_S = 30.0
LOG_COLUMNS = ("run_id", "time", "level", "rank", "role", "message")


class SqliteRunStore:
    """A `RunStore` in one SQLite file. `create=False` refuses to create a missing file."""

    def __init__(self, path: str | Path, *, create: bool = True) -> None:
        self.path = Path(path)
        self._conn = _connect(self.path, create=create)
        self._db = sqlite_utils.Database(self._conn, execute_plugins=False)

    def __enter__(self) -> SqliteRunStore:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._conn.close()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        if self._conn.in_transaction:
            yield
            return
        with _immediate(self._conn):
            yield

    # --- runs

    def create_run(
        self, run_id: str, *, name: str, plan_sha256: str, plan_path: str, run_dir: str
    ) -> RunRecord:
        record = RunRecord(
            run_id=run_id,
            name=name,
            status="planned",
            plan_sha256=plan_sha256,
            plan_path=plan_path,
            run_dir=run_dir,
            created_at=time.time(),
            started_at=None,
            ended_at=None,
            error=None,
            cancel_requested=False,
        )
        try:
            with self.transaction():
                self._db["runs"].insert(asdict(record))
        except sqlite3.IntegrityError:
            raise RolloutError(
                Issue(run_id, f"a run with this id already exists in {self.path}")
            ) from None
        return record

    def set_status(self, run_id: str, status: RunStatus, *, error: str | None = None) -> None:
        if status not in RUN_STATUSES:
            raise ValueError(f"unknown run status {status!r}; expected one of {RUN_STATUSES}")
        with self.transaction():
            changes = _status_changes(self._require(run_id).status, status, time.time())
            if error is not None:
                changes["error"] = error
            self._db["runs"].update(run_id, changes)

    def request_cancel(self, run_id: str) -> None:
        with self.transaction():
            self._require(run_id)
            self._db["runs"].update(run_id, {"cancel_requested": 1})

    # --- ownership

    def claim_run(self, run_id: str, owner: str, *, lease_s: float) -> str | None:
        now = time.time()
        with self.transaction():  # BEGIN IMMEDIATE: two claims cannot both read "free"
            record = self._require(run_id)
            live = record.lease_expires_at is not None and record.lease_expires_at > now
            if record.status == "running" and live and record.owner != owner:
                return record.owner or "another process"
            self._db["runs"].update(
                run_id,
                {
                    "status": "running",
                    "owner": owner,
                    "lease_expires_at": now + lease_s,
                    "started_at": now,
                    "ended_at": None,
                    "error": None,
                    "cancel_requested": 0,
                },
            )
        return None

    def renew_lease(self, run_id: str, owner: str, *, lease_s: float) -> bool:
        with self.transaction():
            cursor = self._conn.execute(
                "UPDATE runs SET lease_expires_at = ? "
                "WHERE run_id = ? AND owner = ? AND status = 'running'",
                (time.time() + lease_s, run_id, owner),
            )
        return cursor.rowcount == 1

    def end_run(
        self, run_id: str, owner: str, status: RunStatus, *, error: str | None = None
    ) -> bool:
        if status not in FINAL_STATUSES:
            raise ValueError(f"{status!r} is not a final status; expected one of {FINAL_STATUSES}")
        with self.transaction():
            cursor = self._conn.execute(
                "UPDATE runs SET status = ?, error = ?, ended_at = ?, owner = NULL, "
                "lease_expires_at = NULL WHERE run_id = ? AND owner = ?",
                (status, error, time.time(), run_id, owner),
            )
        return cursor.rowcount == 1

    def mark_lost(self, run_id: str, owner: str, *, error: str) -> bool:
        with self.transaction():
            cursor = self._conn.execute(
                "UPDATE runs SET status = 'lost', error = ?, ended_at = ?, owner = NULL, "
                "lease_expires_at = NULL WHERE run_id = ? AND owner = ? AND status = 'running'",
                (error, time.time(), run_id, owner),
            )
        return cursor.rowcount == 1

    def expire_leases(self, *, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        where = "status = 'running' AND (lease_expires_at IS NULL OR lease_expires_at < ?)"
        with self.transaction():
            expired = [
                row[0]
                for row in self._conn.execute(f"SELECT run_id FROM runs WHERE {where}", (now,))
            ]
            self._conn.execute(
                "UPDATE runs SET status = 'lost', ended_at = COALESCE(lease_expires_at, ?), "
                "owner = NULL, lease_expires_at = NULL, error = COALESCE(error, "
                "'its owner stopped renewing its lease (killed, or its machine went away); "
                f"re-run the plan to resume it') WHERE {where}",
                (now, now),
            )
        return expired

    def get_run(self, run_id: str) -> RunRecord | None:
        rows = self._db.query("SELECT * FROM runs WHERE run_id = ?", [run_id])
        return next((_run_record(row) for row in rows), None)

    def list_runs(self, *, status: RunStatus | None = None, limit: int = 50) -> list[RunRecord]:
        where, params = ("WHERE status = ?", [status]) if status else ("", [])
        rows = self._db.query(
            f"SELECT * FROM runs {where} ORDER BY created_at DESC, run_id DESC LIMIT ?",
            [*params, limit],
        )
        return [_run_record(row) for row in rows]

    def _require(self, run_id: str) -> RunRecord:
        record = self.get_run(run_id)
        if record is None:
            raise KeyError(f"no run {run_id!r} in {self.path}")
        return record

    # --- rows written during a run

    def add_metrics(self, rows: Iterable[MetricRecord]) -> None:
        rows = list(rows)
        if not rows:
            return
        last_steps: dict[str, int] = {}
        for row in rows:
            last_steps[row.run_id] = max(row.step, last_steps.get(row.run_id, row.step))
        with self.transaction():
            # A resumed run redoes the steps after its checkpoint: the latest row wins.
            self._db["metrics"].insert_all((asdict(row) for row in rows), replace=True)
            # Kept on the run so `runs list` needs no scan over every metric row.
            self._conn.executemany(
                "UPDATE runs SET last_step = MAX(COALESCE(last_step, ?), ?) WHERE run_id = ?",
                [(step, step, run_id) for run_id, step in last_steps.items()],
            )

    def add_logs(self, rows: Iterable[LogRow]) -> None:
        rows = list(rows)
        if not rows:
            return
        with self.transaction():
            self._db["logs"].insert_all(dict(zip(LOG_COLUMNS, row, strict=True)) for row in rows)

    def add_checkpoint(self, record: CheckpointRecord) -> None:
        with self.transaction():
            self._db["checkpoints"].insert(asdict(record), replace=True)

    # --- reads

    def metrics(self, run_id: str, names: Sequence[str] | None = None) -> list[MetricRecord]:
        sql = "SELECT run_id, step, name, value, time FROM metrics WHERE run_id = ?"
        params: list[Any] = [run_id]
        if names is not None:
            sql += f" AND name IN ({_placeholders(len(names))})"
            params += names
        rows = self._db.query(sql + " ORDER BY name, step, time", params)
        return [_metric_record(row) for row in rows]

    def latest_metrics(self, run_id: str) -> Mapping[str, MetricRecord]:
        rows = self._db.query(
            """
            SELECT run_id, step, name, value, time FROM (
                SELECT *, ROW_NUMBER() OVER (PARTITION BY name ORDER BY step DESC, time DESC) AS n
                FROM metrics WHERE run_id = ?
            ) WHERE n = 1 ORDER BY name
            """,
            [run_id],
        )
        return {row["name"]: _metric_record(row) for row in rows}

    def logs(
        self,
        run_id: str,
        *,
        after_id: int = 0,
        level: LogLevel | None = None,
        rank: int | None = None,
        role: str | None = None,
        limit: int = 1000,
        newest_first: bool = False,
    ) -> list[LogRecord]:
        where = ["run_id = ?", "id > ?"]
        params: list[Any] = [run_id, after_id]
        if level is not None:
            severe = LOG_LEVELS[LOG_LEVELS.index(level) :]
            where.append(f"level IN ({_placeholders(len(severe))})")
            params += severe
        if rank is not None:
            where.append("rank = ?")
            params.append(rank)
        if role is not None:
            # A colocated process logs as 'actor+learner': `--role learner` must find it too.
            where.append("instr('+' || role || '+', '+' || ? || '+') > 0")
            params.append(role)
        order = "DESC" if newest_first else "ASC"
        rows = self._db.query(
            f"SELECT * FROM logs WHERE {' AND '.join(where)} ORDER BY id {order} LIMIT ?",
            [*params, limit],
        )
        return [LogRecord(**row) for row in rows]

    def checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        rows = self._db.query("SELECT * FROM checkpoints WHERE run_id = ? ORDER BY step", [run_id])
        return [CheckpointRecord(**row) for row in rows]


def _status_changes(current: RunStatus, new: RunStatus, now: float) -> dict[str, Any]:
    changes: dict[str, Any] = {"status": new}
    if new == "running" and current != "running":
        # A resumed run starts afresh: a new clock, no stale error or cancel request.
        changes.update(started_at=now, ended_at=None, error=None, cancel_requested=0)
    elif new in FINAL_STATUSES and current not in FINAL_STATUSES:
        changes["ended_at"] = now
    return changes


def _run_record(row: dict[str, Any]) -> RunRecord:
    return RunRecord(**{**row, "cancel_requested": bool(row["cancel_requested"])})


def _metric_record(row: dict[str, Any]) -> MetricRecord:
    value = row["value"]
    return MetricRecord(**{**row, "value": math.nan if value is None else value})


def _placeholders(count: int) -> str:
    return ", ".join(["?"] * count)


# --- connection and schema


def _connect(path: Path, *, create: bool) -> sqlite3.Connection:
    if not create and not path.is_file():
        raise FileNotFoundError(f"no run store at {path}")
    # mode=rw (no 'c') keeps a reader from creating an empty store even if the file vanishes
    # between the check above and the open. isolation_level=None: transactions are explicit.
    uri = f"{path.resolve().as_uri()}?mode={'rwc' if create else 'rw'}"
    conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        # Off while migrating: rebuilding a table (migration 2) must not cascade deletes.
        conn.execute("PRAGMA foreign_keys = OFF")
        _migrate(conn)
        conn.execute("PRAGMA foreign_keys = ON")
    except BaseException:
        conn.close()  # not a database, or a newer schema: leave no open handle behind
        raise
    return conn


@contextmanager
def _immediate(conn: sqlite3.Connection) -> Iterator[None]:
    """A write transaction that takes the write lock up front.

    A deferred transaction that reads first and writes later fails at once with SQLITE_BUSY when
    another process wrote in between; an immediate one waits out the busy timeout instead.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _migrate(conn: sqlite3.Connection) -> None:
    latest = MIGRATIONS[-1][0]
    if _schema_version(conn) == latest:
        return  # the common case takes no write lock
    # Two processes opening a fresh file both get here; the write lock lets one migrate while
    # the other waits, then finds the work done.
    with _immediate(conn):
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_version "
            "(version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)"
        )
        current = _schema_version(conn)
        if current > latest:
            raise RolloutError(
                Issue(
                    "run store",
                    f"schema version {current} is newer than this rollout knows ({latest})",
                    hint="upgrade rollout to read this store",
                )
            )
        for number, script in MIGRATIONS:
            if number > current:
                for statement in _statements(script):
                    conn.execute(statement)
                conn.execute("INSERT INTO schema_version VALUES (?, ?)", (number, time.time()))


def _schema_version(conn: sqlite3.Connection) -> int:
    exists = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
    ).fetchone()
    if not exists:
        return 0
    return conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0]


def _statements(script: str) -> Iterator[str]:
    """Split a migration into statements: executescript() would commit our open transaction."""
    statement = ""
    for line in script.splitlines(keepends=True):
        statement += line
        if sqlite3.complete_statement(statement):
            yield statement
            statement = ""
