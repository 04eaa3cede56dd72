"""The run store's rules and statements, written once for both backends.

`SqlRunStore` implements the `RunStore` protocol over a few primitives each backend supplies: run
a statement, run it for many rows, query rows as dicts, and a transaction. Statements use `?`
placeholders and SQL both dialects read (ON CONFLICT upserts, CASE rather than MAX(a, b) or
GREATEST); the few places the dialects differ are class attributes a backend overrides:

- `_LOCK_ROWS`: appended to a SELECT that reads a run before changing it. SQLite's write
  transaction already shuts out every other writer; Postgres needs FOR UPDATE, or two claims of
  one run could both read it free.
- `_FIND`: the function that finds a substring (SQLite `instr`, Postgres `strpos`).
- `_TEXT_ORDER`: how text sorts. SQLite compares bytes; Postgres follows the database's locale
  unless told `COLLATE "C"`, so both list metrics and runs in the same order.

Every write is a function (an "op") handed to `_write`, which runs it in a transaction, or in the
caller's open `transaction()`. A Postgres connection can drop in the middle of one; the backend
then connects again and runs the transaction's ops again, so each op is idempotent: metrics and
checkpoints are upserts, `last_step` only grows, log lines carry keys chosen before the first
attempt, and a run's creation recognizes its own row.
"""

from __future__ import annotations

import json
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, astuple, fields
from typing import Any, TypeVar

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
    SampleRecord,
)

T = TypeVar("T")

RUN_COLUMNS = ", ".join(field.name for field in fields(RunRecord))
LOG_COLUMNS = ", ".join(field.name for field in fields(LogRecord))
LOST_ERROR = (
    "its owner stopped renewing its lease (killed, or its machine went away); "
    "re-run the plan to resume it"
)


class SqlRunStore(ABC):
    """A `RunStore` over a SQL connection; see the module docstring for what a backend adds."""

    location: str
    """Where the store is, for messages: a path, or a DSN's reference (never the DSN)."""
    _LOCK_ROWS = ""
    _FIND = "instr"
    _TEXT_ORDER = ""

    # --- what a backend supplies

    @abstractmethod
    def transaction(self) -> AbstractContextManager[None]:
        """Group writes into one transaction; nested calls join it."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def _write(self, op: Callable[[], T]) -> T:
        """Run `op` (statements through the primitives below) in a transaction."""

    @abstractmethod
    def _read(self, op: Callable[[], T]) -> T: ...

    @abstractmethod
    def _execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; the number of rows it changed."""

    @abstractmethod
    def _executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None: ...

    @abstractmethod
    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]: ...

    def _insert_many(
        self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], conflict: str
    ) -> None:
        """INSERT `rows` into `table` with an ON CONFLICT `conflict` clause; a backend may send
        them as one statement (the rows hold no two with the same conflict key)."""
        self._executemany(
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({_placeholders(len(columns))}) "
            f"ON CONFLICT {conflict}",
            rows,
        )

    def _log_keys(self, count: int) -> list[str | None]:
        """Keys for `count` new log lines (a backend that may write a batch twice sets them)."""
        return [None] * count

    def _serialize_logs(self, run_ids: Sequence[str]) -> None:
        """Make this transaction's log writes for `run_ids` wait for other writers' to commit,
        so ids rise in commit order (a backend whose writers are not serialized already)."""
        return

    def __enter__(self) -> SqlRunStore:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

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
        row = {**asdict(record), "cancel_requested": 0}

        def insert() -> bool:
            if self._execute(
                f"INSERT INTO runs ({', '.join(row)}) VALUES ({_placeholders(len(row))}) "
                "ON CONFLICT (run_id) DO NOTHING",
                list(row.values()),
            ):
                return True
            # A retried insert whose first attempt committed finds its own row.
            found = self._query(
                "SELECT created_at, plan_sha256 FROM runs WHERE run_id = ?", [run_id]
            )
            return found == [{"created_at": record.created_at, "plan_sha256": plan_sha256}]

        if not self._write(insert):
            raise RolloutError(
                Issue(run_id, f"a run with this id already exists in {self.location}")
            )
        return record

    def set_status(self, run_id: str, status: RunStatus, *, error: str | None = None) -> None:
        if status not in RUN_STATUSES:
            raise ValueError(f"unknown run status {status!r}; expected one of {RUN_STATUSES}")

        def change() -> None:
            changes = status_changes(self._locked_run(run_id)["status"], status, time.time())
            if error is not None:
                changes["error"] = error
            self._update_run(run_id, changes)

        self._write(change)

    def request_cancel(self, run_id: str) -> None:
        def cancel() -> int:
            return self._execute("UPDATE runs SET cancel_requested = 1 WHERE run_id = ?", [run_id])

        if not self._write(cancel):
            raise KeyError(f"no run {run_id!r} in {self.location}")

    # --- ownership

    def claim_run(self, run_id: str, owner: str, *, lease_s: float) -> str | None:
        def claim() -> str | None:
            now = time.time()
            run = self._locked_run(run_id)  # two claims cannot both read "free"
            live = run["lease_expires_at"] is not None and run["lease_expires_at"] > now
            if run["status"] == "running" and live and run["owner"] != owner:
                return run["owner"] or "another process"
            self._update_run(
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

        return self._write(claim)

    def renew_lease(self, run_id: str, owner: str, *, lease_s: float) -> bool:
        return self._changes_one_row(
            "UPDATE runs SET lease_expires_at = ? "
            "WHERE run_id = ? AND owner = ? AND status = 'running'",
            lambda: [time.time() + lease_s, run_id, owner],
        )

    def end_run(
        self, run_id: str, owner: str, status: RunStatus, *, error: str | None = None
    ) -> bool:
        if status not in FINAL_STATUSES:
            raise ValueError(f"{status!r} is not a final status; expected one of {FINAL_STATUSES}")
        return self._changes_one_row(
            "UPDATE runs SET status = ?, error = ?, ended_at = ?, owner = NULL, "
            "lease_expires_at = NULL WHERE run_id = ? AND owner = ?",
            lambda: [status, error, time.time(), run_id, owner],
        )

    def mark_lost(self, run_id: str, owner: str, *, error: str) -> bool:
        return self._changes_one_row(
            "UPDATE runs SET status = 'lost', error = ?, ended_at = ?, owner = NULL, "
            "lease_expires_at = NULL WHERE run_id = ? AND owner = ? AND status = 'running'",
            lambda: [error, time.time(), run_id, owner],
        )

    def expire_leases(self, *, now: float | None = None) -> list[str]:
        at = time.time() if now is None else now

        def expire() -> list[str]:
            expired = [
                row["run_id"]
                for row in self._query(
                    "SELECT run_id FROM runs WHERE status = 'running' AND "
                    "(lease_expires_at IS NULL OR lease_expires_at < ?) "
                    f"ORDER BY run_id{self._TEXT_ORDER}{self._LOCK_ROWS}",
                    [at],
                )
            ]
            if expired:
                self._execute(
                    "UPDATE runs SET status = 'lost', ended_at = COALESCE(lease_expires_at, ?), "
                    "owner = NULL, lease_expires_at = NULL, error = COALESCE(error, ?) "
                    f"WHERE run_id IN ({_placeholders(len(expired))})",
                    [at, LOST_ERROR, *expired],
                )
            return expired

        return self._write(expire)

    def get_run(self, run_id: str) -> RunRecord | None:
        rows = self._read(
            lambda: self._query(f"SELECT {RUN_COLUMNS} FROM runs WHERE run_id = ?", [run_id])
        )
        return run_record(rows[0]) if rows else None

    def list_runs(self, *, status: RunStatus | None = None, limit: int = 50) -> list[RunRecord]:
        where, params = ("WHERE status = ?", [status]) if status else ("", [])
        sql = (
            f"SELECT {RUN_COLUMNS} FROM runs {where} "
            f"ORDER BY created_at DESC, run_id{self._TEXT_ORDER} DESC LIMIT ?"
        )
        return [run_record(row) for row in self._read(lambda: self._query(sql, [*params, limit]))]

    def _locked_run(self, run_id: str) -> dict[str, Any]:
        rows = self._query(
            f"SELECT {RUN_COLUMNS} FROM runs WHERE run_id = ?{self._LOCK_ROWS}", [run_id]
        )
        if not rows:
            raise KeyError(f"no run {run_id!r} in {self.location}")
        return rows[0]

    def _update_run(self, run_id: str, changes: Mapping[str, Any]) -> None:
        assignments = ", ".join(f"{column} = ?" for column in changes)
        self._execute(
            f"UPDATE runs SET {assignments} WHERE run_id = ?", [*changes.values(), run_id]
        )

    def _changes_one_row(self, sql: str, params: Callable[[], list[Any]]) -> bool:
        """Run an UPDATE (its parameters taken when it runs); True if it changed one row."""
        return self._write(lambda: self._execute(sql, params())) == 1

    # --- rows written during a run

    def add_metrics(self, rows: Iterable[MetricRecord]) -> None:
        # The last value of a (run, name, step) written twice in one batch wins, as it would
        # across batches; one statement may not upsert a row twice.
        latest = {(row.run_id, row.name, row.step): row for row in rows}
        # One order for every writer: two transactions upserting the same rows never deadlock.
        rows = [latest[key] for key in sorted(latest)]
        if not rows:
            return
        last_steps: dict[str, int] = {}
        for row in rows:
            last_steps[row.run_id] = max(row.step, last_steps.get(row.run_id, row.step))
        values = [astuple(row) for row in rows]

        def write() -> None:
            # A resumed run redoes the steps after its checkpoint: the latest row wins.
            self._insert_many(
                "metrics",
                ("run_id", "step", "name", "value", "time"),
                values,
                "(run_id, name, step) DO UPDATE SET value = excluded.value, time = excluded.time",
            )
            # Kept on the run so `runs list` needs no scan over every metric row.
            self._executemany(
                "UPDATE runs SET last_step = CASE WHEN last_step IS NULL OR last_step < ? "
                "THEN ? ELSE last_step END WHERE run_id = ?",
                [(step, step, run_id) for run_id, step in sorted(last_steps.items())],
            )

        self._write(write)

    def add_logs(self, rows: Iterable[LogRow]) -> None:
        rows = list(rows)
        if not rows:
            return
        # Keys are chosen now, once: written again after a dropped connection, a line that
        # made it the first time is not added twice.
        values = [
            (*row[:5], storable_text(row[5]), row[6] if len(row) > 6 else None, key)
            for row, key in zip(rows, self._log_keys(len(rows)), strict=True)
        ]
        run_ids = sorted({row[0] for row in rows})

        def write() -> None:
            self._serialize_logs(run_ids)
            self._insert_many(
                "logs",
                ("run_id", "time", "level", "rank", "role", "message", "span", "write_key"),
                values,
                "(write_key) DO NOTHING",
            )

        self._write(write)

    def add_checkpoint(self, record: CheckpointRecord) -> None:
        values = astuple(record)
        self._write(
            lambda: self._execute(
                "INSERT INTO checkpoints (run_id, step, location, time) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (run_id, step) "
                "DO UPDATE SET location = excluded.location, time = excluded.time",
                values,
            )
        )

    def add_samples(self, rows: Iterable[SampleRecord]) -> None:
        latest = {(row.run_id, row.step, row.index): row for row in rows}
        values = [_sample_row(latest[key]) for key in sorted(latest)]
        if not values:
            return
        self._write(
            lambda: self._insert_many(
                "samples",
                SAMPLE_COLUMNS,
                values,
                "(run_id, step, sample_index) DO UPDATE SET prompt = excluded.prompt, "
                "completion = excluded.completion, turns = excluded.turns, "
                "reward = excluded.reward, extra = excluded.extra, time = excluded.time",
            )
        )

    # --- reads

    def metrics(self, run_id: str, names: Sequence[str] | None = None) -> list[MetricRecord]:
        sql = "SELECT run_id, step, name, value, time FROM metrics WHERE run_id = ?"
        params: list[Any] = [run_id]
        if names is not None:
            if not names:
                return []
            sql += f" AND name IN ({_placeholders(len(names))})"
            params += names
        sql += f" ORDER BY name{self._TEXT_ORDER}, step, time"
        return [metric_record(row) for row in self._read(lambda: self._query(sql, params))]

    def latest_metrics(self, run_id: str) -> Mapping[str, MetricRecord]:
        sql = f"""
            SELECT run_id, step, name, value, time FROM (
                SELECT run_id, step, name, value, time,
                       ROW_NUMBER() OVER (PARTITION BY name ORDER BY step DESC, time DESC) AS n
                FROM metrics WHERE run_id = ?
            ) AS ranked WHERE n = 1 ORDER BY name{self._TEXT_ORDER}
        """
        rows = self._read(lambda: self._query(sql, [run_id]))
        return {row["name"]: metric_record(row) for row in rows}

    def metric_counts(self, run_id: str) -> Mapping[str, int]:
        sql = (
            "SELECT name, COUNT(*) AS n FROM metrics WHERE run_id = ? "
            f"GROUP BY name ORDER BY name{self._TEXT_ORDER}"
        )
        return {row["name"]: row["n"] for row in self._read(lambda: self._query(sql, [run_id]))}

    def metric_buckets(
        self, run_id: str, name: str, *, width: int
    ) -> list[tuple[int, float | None, float | None, float | None]]:
        if width < 1:
            raise ValueError(f"bucket width {width} is not a positive number of steps")
        # Finite values only, the same test in both dialects: NULL (SQLite's NaN) is not
        # BETWEEN anything, Postgres sorts NaN above every number, and infinities lie outside.
        sql = f"""
            SELECT bucket, AVG(v) AS mean, MIN(v) AS low, MAX(v) AS high FROM (
                SELECT step / ? AS bucket,
                       CASE WHEN value BETWEEN -{_FLOAT_MAX} AND {_FLOAT_MAX} THEN value END AS v
                FROM metrics WHERE run_id = ? AND name = ?
            ) AS steps GROUP BY bucket ORDER BY bucket
        """
        rows = self._read(lambda: self._query(sql, [width, run_id, name]))
        return [
            (
                int(row["bucket"]) * width,
                _float(row["mean"]),
                _float(row["low"]),
                _float(row["high"]),
            )
            for row in rows
        ]

    def logs(
        self,
        run_id: str,
        *,
        after_id: int = 0,
        level: LogLevel | None = None,
        rank: int | None = None,
        role: str | None = None,
        span: str | None = None,
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
            where.append(f"{self._FIND}('+' || role || '+', '+' || ? || '+') > 0")
            params.append(role)
        if span is not None:
            where.append("span = ?")
            params.append(span)
        order = "DESC" if newest_first else "ASC"
        sql = (
            f"SELECT {LOG_COLUMNS} FROM logs WHERE {' AND '.join(where)} "
            f"ORDER BY id {order} LIMIT ?"
        )
        return [LogRecord(**row) for row in self._read(lambda: self._query(sql, [*params, limit]))]

    def checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        sql = "SELECT run_id, step, location, time FROM checkpoints WHERE run_id = ? ORDER BY step"
        return [CheckpointRecord(**row) for row in self._read(lambda: self._query(sql, [run_id]))]

    def sample_steps(self, run_id: str) -> list[int]:
        sql = "SELECT DISTINCT step FROM samples WHERE run_id = ? ORDER BY step"
        return [row["step"] for row in self._read(lambda: self._query(sql, [run_id]))]

    def samples(self, run_id: str, steps: Sequence[int] | None = None) -> list[SampleRecord]:
        sql = f"SELECT {', '.join(SAMPLE_COLUMNS)} FROM samples WHERE run_id = ?"
        params: list[Any] = [run_id]
        if steps is not None:
            if not steps:
                return []
            sql += f" AND step IN ({_placeholders(len(steps))})"
            params += list(steps)
        sql += " ORDER BY step, sample_index"
        return [sample_record(row) for row in self._read(lambda: self._query(sql, params))]


def status_changes(current: RunStatus, new: RunStatus, now: float) -> dict[str, Any]:
    changes: dict[str, Any] = {"status": new}
    if new == "running" and current != "running":
        # A resumed run starts afresh: a new clock, no stale error or cancel request.
        changes.update(started_at=now, ended_at=None, error=None, cancel_requested=0)
    elif new in FINAL_STATUSES and current not in FINAL_STATUSES:
        changes["ended_at"] = now
    return changes


def run_record(row: Mapping[str, Any]) -> RunRecord:
    return RunRecord(**{**row, "cancel_requested": bool(row["cancel_requested"])})


def metric_record(row: Mapping[str, Any]) -> MetricRecord:
    value = row["value"]  # SQLite keeps a NaN as NULL
    return MetricRecord(**{**row, "value": math.nan if value is None else value})


SAMPLE_COLUMNS = (
    "run_id",
    "step",
    "sample_index",
    "prompt",
    "completion",
    "turns",
    "reward",
    "extra",
    "time",
)


def storable_text(text: str) -> str:
    """`text` as both backends store it: Postgres text cannot hold NUL (a random model's
    completion, a plugin's log line can), so it becomes U+FFFD, in SQLite too, so that either
    store reads back the same string. JSON columns need nothing: json.dumps escapes NUL."""
    return text.replace("\x00", "\ufffd")


def _sample_row(record: SampleRecord) -> tuple[Any, ...]:
    turns = None if record.turns is None else json.dumps(record.turns, ensure_ascii=False)
    reward = None if math.isnan(record.reward) else record.reward
    extra = json.dumps(record.extra, ensure_ascii=False, sort_keys=True, default=str)
    completion = None if record.completion is None else storable_text(record.completion)
    return (
        record.run_id,
        record.step,
        record.index,
        storable_text(record.prompt),
        completion,
        turns,
        reward,
        extra,
        record.time,
    )


def sample_record(row: Mapping[str, Any]) -> SampleRecord:
    return SampleRecord(
        run_id=row["run_id"],
        step=row["step"],
        index=row["sample_index"],
        prompt=row["prompt"],
        completion=row["completion"],
        turns=None if row["turns"] is None else json.loads(row["turns"]),
        reward=math.nan if row["reward"] is None else row["reward"],
        extra=json.loads(row["extra"]),
        time=row["time"],
    )


_FLOAT_MAX = "1.7976931348623157e308"


def _float(value: Any) -> float | None:
    return None if value is None else float(value)  # Postgres's AVG of a BIGINT is a Decimal


def _placeholders(count: int) -> str:
    return ", ".join(["?"] * count)
