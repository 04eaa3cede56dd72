"""The run store's interface: one schema, two backends (SQLite embedded; Postgres later).

Workers write through a background writer (never on the hot path); the CLI reads. Every value is
a bound parameter. Records are plain frozen dataclasses so readers need no ORM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

RunStatus = Literal["planned", "running", "stopped", "failed", "finished"]
RUN_STATUSES: tuple[RunStatus, ...] = ("planned", "running", "stopped", "failed", "finished")
LogLevel = Literal["debug", "info", "warning", "error"]


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    name: str
    status: RunStatus
    plan_sha256: str
    plan_path: str
    run_dir: str
    created_at: float
    started_at: float | None
    ended_at: float | None
    error: str | None
    """The first failure's message and traceback, when status is 'failed'."""
    cancel_requested: bool


@dataclass(frozen=True)
class MetricRecord:
    run_id: str
    step: int
    name: str
    value: float
    time: float


@dataclass(frozen=True)
class LogRecord:
    id: int
    run_id: str
    time: float
    level: LogLevel
    rank: int
    role: str
    message: str


@dataclass(frozen=True)
class CheckpointRecord:
    run_id: str
    step: int
    location: str
    time: float


class RunStore(Protocol):
    # --- runs
    def create_run(
        self, run_id: str, *, name: str, plan_sha256: str, plan_path: str, run_dir: str
    ) -> RunRecord: ...
    def set_status(self, run_id: str, status: RunStatus, *, error: str | None = None) -> None: ...
    def request_cancel(self, run_id: str) -> None: ...
    def get_run(self, run_id: str) -> RunRecord | None: ...
    def list_runs(self, *, status: RunStatus | None = None, limit: int = 50) -> list[RunRecord]: ...

    # --- rows written during a run (batched by the background writer)
    def add_metrics(self, rows: Iterable[MetricRecord]) -> None: ...
    def add_logs(self, rows: Iterable[tuple[str, float, LogLevel, int, str, str]]) -> None: ...
    def add_checkpoint(self, record: CheckpointRecord) -> None: ...

    # --- reads
    def metrics(self, run_id: str, names: Sequence[str] | None = None) -> list[MetricRecord]: ...
    def latest_metrics(self, run_id: str) -> Mapping[str, MetricRecord]: ...
    def logs(
        self,
        run_id: str,
        *,
        after_id: int = 0,
        level: LogLevel | None = None,
        rank: int | None = None,
        role: str | None = None,
        limit: int = 1000,
    ) -> list[LogRecord]: ...
    def checkpoints(self, run_id: str) -> list[CheckpointRecord]: ...
    def close(self) -> None: ...
