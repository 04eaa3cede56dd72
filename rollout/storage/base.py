"""The run store's interface: one schema, two backends (SQLite embedded; Postgres shared).

Workers write through a background writer (never on the hot path); the CLI reads. Every value is
a bound parameter. Records are plain frozen dataclasses so readers need no ORM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

RunStatus = Literal["planned", "running", "stopped", "failed", "finished", "lost"]
RUN_STATUSES: tuple[RunStatus, ...] = (
    "planned",
    "running",
    "stopped",
    "failed",
    "finished",
    "lost",
)
FINAL_STATUSES: tuple[RunStatus, ...] = ("stopped", "failed", "finished", "lost")
"""Statuses of a run that is not going on. 'lost': its owner died without saying how it ended
(its lease ran out); like 'stopped' and 'failed', re-running the plan resumes it."""
LogLevel = Literal["debug", "info", "warning", "error"]
LOG_LEVELS: tuple[LogLevel, ...] = ("debug", "info", "warning", "error")
"""Least to most severe: filtering on a level keeps that level and the ones after it."""


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
    last_step: int | None = None
    """The highest step any metric of this run was written for; None before the first."""
    owner: str | None = None
    """Who runs it (rollout.executor.ownership.Owner as JSON), while it runs."""
    lease_expires_at: float | None = None
    """The owner renews this while it lives; a running run past it is lost."""


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
    span: str | None = None
    """The span or phase the line was written in (rollout.tracing); None outside every span."""


@dataclass(frozen=True)
class CheckpointRecord:
    run_id: str
    step: int
    location: str
    time: float


MAX_SAMPLE_TEXT = 4000
"""Characters of one sample text (a prompt, a completion, a turn) a run report shows, and an
agent episode's turns keep when recorded (its calls' texts would otherwise grow without bound)."""


def clip_text(text: str, limit: int = MAX_SAMPLE_TEXT) -> str:
    """`text` cut to `limit` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"… [{len(text) - limit} more characters]"


@dataclass(frozen=True)
class SampleRecord:
    """One sample completion recorded at a training step (logging.samples_per_step)."""

    run_id: str
    step: int
    index: int
    """Its place among the step's recorded samples (0, 1, ...)."""
    prompt: str
    completion: str | None
    """The completion's text; None for an environment episode (see `turns`); an agent
    episode's final answer."""
    turns: list[dict[str, Any]] | None
    """A multi-turn episode's messages after the prompt, [{"role", "content"}, ...]; an agent
    episode's assistant turns also say which call they answered ("call", from 1), its
    "policy_version", "tokens" and "finish_reason"."""
    reward: float
    """Its total reward (an episode's return); NaN if none."""
    extra: dict[str, Any]
    """JSON-able facts besides (the reward functions' scores, the finish reason, ...)."""
    time: float


LogRow = (
    tuple[str, float, LogLevel, int, str, str]
    | tuple[str, float, LogLevel, int, str, str, str | None]
)
"""A log line to add: (run_id, time, level, rank, role, message[, span]); the store assigns its
id. Without a span, the line belongs to none."""


class RunStore(Protocol):
    """One store object per process and thread: backends hold one connection, not a pool."""

    # --- runs
    def create_run(
        self, run_id: str, *, name: str, plan_sha256: str, plan_path: str, run_dir: str
    ) -> RunRecord:
        """A new run in status 'planned'. An existing run_id is a RolloutError."""

    def set_status(self, run_id: str, status: RunStatus, *, error: str | None = None) -> None:
        """Entering 'running' (from another status) stamps started_at and clears ended_at, error
        and cancel_requested: a resumed run starts afresh. Entering a final status from a
        non-final one stamps ended_at. KeyError if the run does not exist."""

    def request_cancel(self, run_id: str) -> None:
        """Set cancel_requested; the executor stops the run. KeyError if it does not exist."""

    # --- ownership: one owner runs a run, and proves it is alive by renewing a lease
    def claim_run(self, run_id: str, owner: str, *, lease_s: float) -> str | None:
        """Atomically make `owner` the run's owner, status 'running', as a fresh start
        (started_at now; ended_at, error and any leftover cancel request cleared), unless
        another owner's lease is still live: then change nothing and return that owner.
        KeyError if the run does not exist."""

    def renew_lease(self, run_id: str, owner: str, *, lease_s: float) -> bool:
        """Extend `owner`'s lease by `lease_s` from now; False if the run is not `owner`'s."""

    def end_run(
        self, run_id: str, owner: str, status: RunStatus, *, error: str | None = None
    ) -> bool:
        """The owner's final word: `status`, ended_at now, lease released. False (and nothing
        changed) if the run is no longer `owner`'s."""

    def mark_lost(self, run_id: str, owner: str, *, error: str) -> bool:
        """A running run whose `owner` is known to be dead becomes 'lost' now."""

    def expire_leases(self, *, now: float | None = None) -> list[str]:
        """Every running run whose lease ran out becomes 'lost'; their ids."""

    def get_run(self, run_id: str) -> RunRecord | None: ...
    def list_runs(self, *, status: RunStatus | None = None, limit: int = 50) -> list[RunRecord]:
        """Newest first (by created_at)."""

    # --- rows written during a run (batched by the background writer)
    def transaction(self) -> AbstractContextManager[None]:
        """Group writes into one transaction (the writer's flush); nested calls join it. Writes
        inside it return nothing a caller should rely on (Postgres may run them again on a new
        connection after the transaction's body has ended)."""

    def add_metrics(self, rows: Iterable[MetricRecord]) -> None:
        """A NaN value is kept (read back as NaN). Also updates the run's last_step."""

    def add_logs(self, rows: Iterable[LogRow]) -> None: ...
    def add_checkpoint(self, record: CheckpointRecord) -> None:
        """A second checkpoint at the same step of a run replaces the first."""

    def add_samples(self, rows: Iterable[SampleRecord]) -> None:
        """A second sample at the same (run, step, index) replaces the first."""

    # --- reads
    def metrics(self, run_id: str, names: Sequence[str] | None = None) -> list[MetricRecord]:
        """Ordered by name, then step: each metric's series in step order."""

    def latest_metrics(self, run_id: str) -> Mapping[str, MetricRecord]:
        """Each metric's row at its highest step."""

    def metric_counts(self, run_id: str) -> Mapping[str, int]:
        """How many rows (steps) each metric of the run has, by name."""

    def metric_buckets(
        self, run_id: str, name: str, *, width: int
    ) -> list[tuple[int, float | None, float | None, float | None]]:
        """One metric thinned in the store: per bucket of `width` steps (bucket k holds steps
        k*width .. k*width + width - 1), (k*width, mean, min, max) of its finite values (None
        where it has none), by bucket. A million rows come back as a few thousand."""

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
        """Lines with id > after_id, by id. `level` keeps that level and above; `role` also
        matches a colocated process logged as 'actor+learner'; `span`: lines written inside that
        span. newest_first: the last `limit` lines, newest first (for `tail -n`)."""

    def checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        """Ordered by step."""

    def sample_steps(self, run_id: str) -> list[int]:
        """The steps that have recorded samples, ascending."""

    def samples(self, run_id: str, steps: Sequence[int] | None = None) -> list[SampleRecord]:
        """The samples of `steps` (None: every step), by step, then index."""

    def close(self) -> None: ...
