"""The Postgres run store: one database for runs whose processes live on several machines.

The same tables, the same numbered migrations and the same statements as SQLite (rollout.storage.
sql); what differs is the connection, which can drop: a server restarts, a proxy times out, an
administrator ends the backend. A `PostgresRunStore` then connects again and writes again, for
up to `reconnect_s` seconds, and nothing is lost or written twice:

- a write outside `transaction()` is retried whole;
- inside `transaction()` (the background writer's batch), the store keeps each write as a
  function; when the connection drops, at any statement or at the COMMIT itself, the whole batch
  runs again in a new transaction on a new connection. A COMMIT that dropped may have happened,
  so every write is idempotent (see rollout.storage.sql): the batch written again changes nothing
  that made it the first time;
- a deadlock or serialization failure (the server rolled the transaction back) is retried the
  same way.

Two writers of one run take turns at writing log lines (an advisory lock per run, held to their
COMMIT), so a run's log ids rise in the order they become visible, and `logs tail --follow`,
which pages by id, never skips a line committed late.

Migrations run under an advisory lock in their own transaction (Postgres DDL is transactional):
any number of processes opening an empty database at once migrate it once.

The store is named by a reference to its DSN (`postgres:env:ROLLOUT_PG_DSN`); the DSN itself
lives only in this object, never in a message, a log line or a record. One object per process
and thread, like the SQLite store.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from functools import lru_cache
from typing import Any, TypeVar

import psycopg
from psycopg import conninfo
from psycopg.rows import dict_row

from rollout.errors import Issue, RolloutError
from rollout.redact import redact_text
from rollout.storage.migrations import LATEST, pending
from rollout.storage.sql import SqlRunStore

T = TypeVar("T")

RECONNECT_S = 30.0
"""How long a dropped connection is retried before the write fails (SQLite's busy timeout)."""
CONNECT_TIMEOUT_S = 10
IDLE_IN_TRANSACTION = "60s"
ROLLED_BACK = (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected)
"""Errors for which the server rolled the transaction back and asks for it again."""
_COLUMN_TYPES = {
    "run_id": "text",
    "step": "bigint",
    "name": "text",
    "value": "double precision",
    "time": "double precision",
    "level": "text",
    "rank": "integer",
    "role": "text",
    "message": "text",
    "write_key": "text",
    "sample_index": "integer",
    "prompt": "text",
    "completion": "text",
    "turns": "text",
    "reward": "double precision",
    "extra": "text",
}
"""The Postgres type of each column that _insert_many sends as an array."""
_PYTHON_TYPES: dict[str, Callable[[Any], Any]] = {
    "text": str,
    "bigint": int,
    "integer": int,
    "double precision": float,
}
# Advisory lock classes (the first key of the two-key form), so rollout's locks never meet
# another application's single-key ones.
MIGRATION_LOCK = 0x526F6C6C  # "Roll"
LOGS_LOCK = 0x526F6C6D


class PostgresRunStore(SqlRunStore):
    """A `RunStore` in a Postgres database (the schema the DSN's search_path names first).

    `location` names the store in messages (the DSN's reference); `create=False` refuses a
    database that holds no run store yet.
    """

    _LOCK_ROWS = " FOR UPDATE"
    _FIND = "strpos"
    _TEXT_ORDER = ' COLLATE "C"'

    def __init__(
        self,
        dsn: str,
        *,
        location: str,
        create: bool = True,
        reconnect_s: float = RECONNECT_S,
    ) -> None:
        self.location = location
        self.reconnect_s = reconnect_s
        try:
            self._dsn = _with_defaults(dsn)
        except psycopg.ProgrammingError:
            # libpq's message quotes the DSN, password and all: not repeated.
            raise RolloutError(
                Issue(
                    location,
                    "the DSN it names is not a libpq connection string "
                    "('host=... dbname=... user=...') or a postgresql:// URL",
                )
            ) from None
        self._conn: psycopg.Connection[dict[str, Any]] | None = None
        self._ops: list[Callable[[], object]] | None = None
        """The writes of the open transaction(), to run again on a new connection."""
        self._replay = False
        """The open transaction was lost (or rolled back by the server): run its writes again."""
        try:
            self._connect()
        except psycopg.OperationalError as error:
            raise RolloutError(
                Issue(
                    "run store",
                    f"cannot connect to the postgres run store {location} "
                    f"({describe_target(dsn)}): {_first_line(error)}",
                    hint="check that the server answers there and that the DSN is right",
                )
            ) from None
        target = describe_target(dsn)
        try:
            self._retrying(lambda: _migrate(self._connection(), create, location, target))
        except psycopg.Error as error:
            self.close()
            raise RolloutError(
                Issue(
                    location,
                    f"cannot create the run store's tables in {target}: {_first_line(error)}",
                    hint="the DSN's user needs CREATE on the schema its search_path names first",
                )
            ) from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    @property
    def backend_pid(self) -> int | None:
        """The server process serving this store's connection (what pg_terminate_backend takes)."""
        return None if self._conn is None or self._conn.closed else self._conn.info.backend_pid

    @contextmanager
    def transaction(self) -> Iterator[None]:
        if self._ops is not None:
            yield
            return
        self._ops, self._replay = [], self._is_lost()
        try:
            yield
            self._commit(self._ops)
        except BaseException:
            self._rollback_quietly()
            raise
        finally:
            self._ops = None

    # --- the primitives SqlRunStore builds on

    def _write(self, op: Callable[[], T]) -> T:
        if self._ops is None:
            return self._retrying(op)
        # Inside transaction(): kept, to run again if the transaction is lost. What a lost write
        # would have returned is not known until then: None (the writer's writes return none).
        self._ops.append(op)
        if self._replay:
            return None  # type: ignore[return-value]
        try:
            return op()
        except psycopg.Error as error:
            if not self._retryable(error):
                raise
            self._replay = True
            return None  # type: ignore[return-value]

    def _read(self, op: Callable[[], T]) -> T:
        if self._ops is None:
            return self._retrying(op)
        if self._replay:
            raise self._gone(None)  # a read inside a lost transaction has nothing to read
        return op()

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        with self._connection().cursor() as cursor:
            cursor.execute(_dialect(sql), params)
            return cursor.rowcount

    def _executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self._connection().cursor() as cursor:
            cursor.executemany(_dialect(sql), rows)

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self._connection().cursor() as cursor:
            cursor.execute(_dialect(sql), params)
            return cursor.fetchall()

    def _insert_many(
        self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], conflict: str
    ) -> None:
        # One statement, one array per column: a batch of 500 rows costs one round trip and
        # one plan instead of 500 (8 writers at 1,000 rows/s each outran executemany).
        # psycopg sends a list as an array of one type: an int among floats is made a float.
        arrays = [
            [
                None if value is None else _PYTHON_TYPES[_COLUMN_TYPES[name]](value)
                for value in column
            ]
            for name, column in zip(columns, zip(*rows, strict=True), strict=True)
        ]
        casts = ", ".join(f"%s::{_COLUMN_TYPES[column]}[]" for column in columns)
        with self._connection().cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {table} ({', '.join(columns)}) "
                f"SELECT * FROM unnest({casts}) ON CONFLICT {conflict}",
                arrays,
            )

    def _log_keys(self, count: int) -> list[str | None]:
        batch = secrets.token_hex(8)
        return [f"{batch}-{index}" for index in range(count)]

    def _serialize_logs(self, run_ids: Sequence[str]) -> None:
        for run_id in run_ids:  # sorted by the caller: one lock order for every writer
            self._execute(f"SELECT pg_advisory_xact_lock({LOGS_LOCK}, hashtext(?))", [run_id])

    # --- connections, retries

    def _connection(self) -> psycopg.Connection[dict[str, Any]]:
        if self._conn is None or self._conn.closed:
            raise self._gone(None)
        return self._conn

    def _connect(self) -> None:
        self._conn = psycopg.connect(self._dsn, autocommit=False, row_factory=dict_row)
        # A writer's transaction runs its statements back to back. One left open (its machine
        # vanished mid-batch, which the server learns late) would hold its run's log lock
        # from every other writer: the server ends such a session instead.
        self._conn.execute(f"SET idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION}'")
        self._conn.commit()

    def _is_lost(self) -> bool:
        return self._conn is None or self._conn.closed or self._conn.broken

    def _retryable(self, error: psycopg.Error) -> bool:
        """Whether running the transaction again can succeed: the server rolled it back
        (deadlock, serialization failure), or the connection failed (a server restart,
        pg_terminate_backend, a network cut). A connection in doubt is closed, never used
        again: one killed in the middle of a pipeline can fail with 'cannot exit pipeline mode
        while busy' and still look open."""
        if isinstance(error, ROLLED_BACK):
            return True
        if self._is_lost() or _connection_failed(error):
            self.close()
            return True
        return False

    def _retrying(self, op: Callable[[], T]) -> T:
        """`op` in one transaction, run again (on a new connection if the old one dropped)
        until it commits or `reconnect_s` has passed."""
        deadline = time.monotonic() + self.reconnect_s
        pause = 0.05
        while True:
            try:
                if self._is_lost():
                    self.close()
                    self._conn = None
                    self._connect()
                result = op()
                self._connection().commit()
                return result
            except psycopg.Error as error:
                self._rollback_quietly()
                if not self._retryable(error):
                    raise
                if time.monotonic() + pause > deadline:
                    raise self._gone(error) from None
            except BaseException:
                self._rollback_quietly()
                raise
            time.sleep(pause)
            pause = min(1.0, pause * 2)

    def _commit(self, ops: list[Callable[[], object]]) -> None:
        if not self._replay:
            try:
                self._connection().commit()
                return
            except psycopg.Error as error:
                if not self._retryable(error):
                    raise
        self._rollback_quietly()
        # Every write of the batch again, in order, in one new transaction.
        self._retrying(lambda: [op() for op in ops])

    def _rollback_quietly(self) -> None:
        if self._conn is not None and not self._is_lost():
            with suppress(psycopg.Error):
                self._conn.rollback()

    def _gone(self, error: psycopg.Error | None) -> RolloutError:
        why = f": {_first_line(error)}" if error is not None else ""
        return RolloutError(
            Issue(
                "run store",
                f"lost the connection to the postgres run store {self.location} and could not "
                f"write again within {self.reconnect_s:g} s{why}",
                hint="check that the server is up and answers from this machine",
            )
        )


# --- schema


def _migrate(
    conn: psycopg.Connection[dict[str, Any]], create: bool, location: str, target: str
) -> None:
    """Apply the missing migrations in the open transaction (the caller commits)."""
    current = _schema_version(conn)
    if current == LATEST:
        return  # the common case takes no lock
    if current is None and not create:
        raise RolloutError(
            Issue(
                location,
                f"no run store here ({target} has no rollout tables in its schema)",
                hint="a run creates its store when it starts; check the DSN's database and "
                "search_path",
            )
        )
    # Two processes opening an empty database both get here: the lock lets one migrate while
    # the others wait, then find the work done.
    conn.execute(
        f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK}, hashtext(COALESCE(current_schema(), '')))"
    )
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_version "
        "(version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
    )
    for migration in pending(_schema_version(conn) or 0):
        conn.execute(migration.postgres)
        conn.execute("INSERT INTO schema_version VALUES (%s, %s)", (migration.number, time.time()))


def _schema_version(conn: psycopg.Connection[dict[str, Any]]) -> int | None:
    """The newest migration applied, 0 for an empty table, None when there is no store."""
    found = conn.execute("SELECT to_regclass('schema_version') IS NOT NULL AS present")
    if not found.fetchone()["present"]:
        return None
    found = conn.execute("SELECT COALESCE(MAX(version), 0) AS version FROM schema_version")
    return int(found.fetchone()["version"])


# --- the DSN


def _with_defaults(dsn: str) -> str:
    """The DSN with a connect timeout and an application name, unless it sets its own."""
    params = conninfo.conninfo_to_dict(dsn)
    params.setdefault("connect_timeout", CONNECT_TIMEOUT_S)
    params.setdefault("application_name", "rollout")
    return conninfo.make_conninfo(**params)


def describe_target(dsn: str) -> str:
    """'database test on 127.0.0.1:5432 as postgres': where a DSN points, never its password."""
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "a DSN that does not parse"
    host = params.get("host") or params.get("hostaddr") or "the local socket"
    port = params.get("port") or "5432"
    database = params.get("dbname") or params.get("user") or "(default)"
    user = f" as {params['user']}" if params.get("user") else ""
    return redact_text(f"database {database} on {host}:{port}{user}")


def _connection_failed(error: psycopg.Error) -> bool:
    """The connection failed, not the statement: an OperationalError with no SQLSTATE (raised by
    the client), or a connection exception (08...) or shutdown (57P0x) from the server."""
    state = error.sqlstate or ""
    return isinstance(error, psycopg.OperationalError) and (
        not state or state.startswith(("08", "57P"))
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return redact_text(text[0] if text else type(error).__name__)


@lru_cache(maxsize=256)
def _dialect(sql: str) -> str:
    """The shared statements' `?` placeholders as psycopg's `%s` (a literal % doubled)."""
    return sql.replace("%", "%%").replace("?", "%s")
