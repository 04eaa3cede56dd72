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

import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from rollout.storage.migrations import LATEST, pending
from rollout.storage.sql import SqlRunStore

BUSY_TIMEOUT_S = 30.0
T = TypeVar("T")


class SqliteRunStore(SqlRunStore):
    """A `RunStore` in one SQLite file. `create=False` refuses to create a missing file."""

    def __init__(self, path: str | Path, *, create: bool = True) -> None:
        self.path = Path(path)
        self.location = str(self.path)
        self._conn = _connect(self.path, create=create)

    def close(self) -> None:
        self._conn.close()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        if self._conn.in_transaction:
            yield
            return
        with _immediate(self._conn):
            yield

    def _write(self, op: Callable[[], T]) -> T:
        with self.transaction():  # BEGIN IMMEDIATE: no other writer reads in between
            return op()

    def _read(self, op: Callable[[], T]) -> T:
        return op()

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self._conn.execute(sql, params).rowcount

    def _executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self._conn.executemany(sql, rows)

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        cursor = self._conn.execute(sql, params)
        columns = [column[0] for column in cursor.description]
        return [dict(zip(columns, row, strict=True)) for row in cursor]


# --- connection and schema


def _connect(path: Path, *, create: bool) -> sqlite3.Connection:
    if not create and not path.is_file():
        raise FileNotFoundError(f"no run store at {path}")
    # mode=rw (no 'c') keeps a reader from creating an empty store even if the file vanishes
    # between the check above and the open. isolation_level=None: transactions are explicit.
    uri = f"{path.resolve().as_uri()}?mode={'rwc' if create else 'rw'}"
    conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    try:
        _retry_while_locked(lambda: _prepare(conn))
    except BaseException:
        conn.close()  # not a database, or a newer schema: leave no open handle behind
        raise
    return conn


def _prepare(conn: sqlite3.Connection) -> None:
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    # Off while migrating: rebuilding a table (migration 2) must not cascade deletes.
    conn.execute("PRAGMA foreign_keys = OFF")
    _migrate(conn)
    conn.execute("PRAGMA foreign_keys = ON")


def _retry_while_locked(step: Callable[[], None]) -> None:
    """Run `step`, retrying while another connection holds the file, up to the busy timeout.

    Switching a fresh file to WAL takes an exclusive lock, and SQLite reports SQLITE_BUSY for
    that switch (and for reads during another connection's WAL recovery) at once, without
    calling the busy handler: several processes opening a new store together would otherwise
    fail with "database is locked" although the timeout had not run out.
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    delay = 0.005
    while True:
        try:
            step()
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


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
    if _schema_version(conn) == LATEST:
        return  # the common case takes no write lock
    # Two processes opening a fresh file both get here; the write lock lets one migrate while
    # the other waits, then finds the work done.
    with _immediate(conn):
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_version "
            "(version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)"
        )
        for migration in pending(_schema_version(conn)):
            for statement in _statements(migration.sqlite):
                conn.execute(statement)
            conn.execute(
                "INSERT INTO schema_version VALUES (?, ?)", (migration.number, time.time())
            )


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
