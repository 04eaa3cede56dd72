"""[logging] trackers: rank 0's metric rows, copied to a JSON-lines file, TensorBoard, Weights &
Biases or MLflow, off the hot path.

The run store's background writer hands every batch of metric rows it wrote to one `TrackerSink`
(a `rollout.storage.writer.MetricSink`), which queues them for a thread of its own: a slow or hung
tracker (a server that does not answer) delays neither training nor the run store. Each tracker
opens on its first rows, on that thread, so its import and start-up (seconds for wandb) cost the
training loop nothing. A tracker that raises is reported once, as a warning naming it and the
error, and disabled; the others go on. The writer closes the sink when it stops, on every exit
path of the worker (end, stop, failure), and the sink then closes each tracker.

The console tracker is not here: the host draws it from the run store.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from rollout.files import read_secret
from rollout.planner.placement import recording_rank
from rollout.storage.base import MetricRecord

if TYPE_CHECKING:
    from rollout.planner.definition import Plan
    from rollout.plugins.identity import PluginIdentity
    from rollout.storage.writer import MetricSink

log = logging.getLogger("rollout.trackers")

JSONL_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"
MLFLOW_BATCH_LIMIT = 1000  # metrics per log_batch call, MLflow's own limit
CLOSE_TIMEOUT_S = 300.0


class Tracker(Protocol):
    """One metric destination. `log` gets rows in the order they were written (steps never go
    down within a run attempt) and may be slow; `close` ends it once, after the last `log`."""

    name: str

    def log(self, rows: Sequence[MetricRecord]) -> None: ...

    def close(self) -> None: ...


# --- jsonl


class JsonlTracker:
    """`<run_dir>/metrics.jsonl`: one JSON object per metric row, appended,
    ``{"step": 3, "name": "train/loss", "value": 0.25, "time": 1732000000.5}`` (time in Unix
    seconds; value null when it is NaN or infinite, which JSON cannot hold).

    Each batch is one unbuffered append, so the file always ends on a whole line: a write that
    fails part-way (disk full) is cut back, and a last line without its newline (a power cut) is
    dropped when the file is opened again. A resumed run appends the steps after its checkpoint
    again: the last line for a step and name wins.
    """

    name = "jsonl"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: Any = None

    @classmethod
    def from_plan(cls, plan: Plan) -> JsonlTracker:
        return cls(Path(plan.derived.run_dir) / JSONL_FILE)

    def log(self, rows: Sequence[MetricRecord]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _drop_partial_last_line(self.path)
            self._file = self.path.open("ab", buffering=0)
        data = memoryview("".join(_json_line(row) for row in rows).encode())
        start = self._file.tell()
        try:
            while data:
                data = data[self._file.write(data) :]
        except BaseException:
            self._file.truncate(start)  # a line cut short is no line at all
            raise

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _json_line(row: MetricRecord) -> str:
    value = row.value if math.isfinite(row.value) else None
    return json.dumps({"step": row.step, "name": row.name, "value": value, "time": row.time}) + "\n"


def _drop_partial_last_line(path: Path, chunk: int = 1 << 16) -> None:
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("r+b") as file:
        end = file.seek(0, os.SEEK_END)
        position = end
        while position > 0:
            start = max(0, position - chunk)
            file.seek(start)
            block = file.read(position - start)
            newline = block.rfind(b"\n")
            if newline >= 0:
                if start + newline + 1 < end:
                    file.truncate(start + newline + 1)
                return
            position = start
        file.truncate(0)  # not one whole line in it


# --- tensorboard


class TensorBoardTracker:
    """Event files in `<run_dir>/tensorboard/` (tensorboardX), one scalar per metric row at its
    step, flushed after every batch. View with `tensorboard --logdir <run_dir>/tensorboard`."""

    name = "tensorboard"

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self._writer: Any = None

    @classmethod
    def from_plan(cls, plan: Plan) -> TensorBoardTracker:
        return cls(Path(plan.derived.run_dir) / TENSORBOARD_DIR)

    def log(self, rows: Sequence[MetricRecord]) -> None:
        if self._writer is None:
            from tensorboardX import SummaryWriter

            # A NaN metric is a value the run store keeps too, not news for stderr at every step.
            logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
            # A resumed run repeats the steps after its checkpoint: purge_step makes TensorBoard
            # drop the first attempt's events from the first step this attempt writes.
            self._writer = SummaryWriter(
                logdir=str(self.logdir), purge_step=min(row.step for row in rows)
            )
        for row in rows:
            self._writer.add_scalar(row.name, row.value, global_step=row.step, walltime=row.time)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# --- wandb


class WandbTracker:
    """A Weights & Biases run in `logging.wandb_project`, named and identified by the run id (a
    resumed rollout run resumes it), with the resolved config as its config; its local files go
    to `<run_dir>/wandb/`. `WANDB_MODE=offline` keeps everything local (`wandb sync` uploads it
    later). The API key reference is read here, at run time, and handed to wandb in memory only.
    """

    name = "wandb"

    def __init__(self, plan: Plan) -> None:
        logging_section = plan.config.logging
        self.project = logging_section.wandb_project
        self.api_key = logging_section.wandb_api_key  # a reference (env:/file:), never the key
        self.run_id = plan.run_id
        self.directory = Path(plan.derived.run_dir)
        self.config = plan.config.model_dump(mode="json")
        self._run: Any = None

    def log(self, rows: Sequence[MetricRecord]) -> None:
        run = self._run if self._run is not None else self._start()
        # Rows of one step become one history row; wandb commits it when a later step arrives.
        for step, values in _by_step(rows):
            run.log(values, step=step)

    def _start(self) -> Any:
        import wandb

        options: dict[str, Any] = {"console": "off", "silent": True}
        if self.api_key is not None:
            options["api_key"] = read_secret(self.api_key)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=self.project,
            name=self.run_id,
            id=self.run_id,
            resume="allow",
            dir=str(self.directory),
            config=self.config,
            settings=wandb.Settings(**options),
        )
        # An offline run has no URL: name its directory (<run_dir>/wandb/offline-run-...).
        where = Path(self._run.dir).parent if self._run.offline else self._run.url
        log.info("wandb run %s: %s", self.run_id, where)
        return self._run

    def close(self) -> None:
        if self._run is not None:
            import wandb

            self._run.finish()
            self._run = None
            # finish() may return before wandb's service has written the run's file; teardown
            # waits for it, and forgets the API key. Only this tracker uses wandb in a worker.
            wandb.teardown()


# --- mlflow


class MlflowTracker:
    """An MLflow run tagged `rollout.run_id` (a resumed rollout run continues it) in experiment
    `logging.mlflow_experiment` (default: the run name), at `logging.mlflow_tracking_uri`
    (default: the file store `<run_dir>/mlruns`). Rows go in `log_batch` calls of at most 1000.
    """

    name = "mlflow"

    def __init__(self, plan: Plan) -> None:
        section = plan.config.logging
        self.tracking_uri = tracking_uri(
            section.mlflow_tracking_uri, Path(plan.base_dir), Path(plan.derived.run_dir)
        )
        self.experiment = section.mlflow_experiment or plan.config.run.name
        self.run_tags = {
            "rollout.run_id": plan.run_id,
            "rollout.algorithm": plan.config.algorithm.kind,
        }
        self._client: Any = None
        self._run_id: str | None = None

    def log(self, rows: Sequence[MetricRecord]) -> None:
        from mlflow.entities import Metric

        if self._client is None:
            self._start()
        metrics = [Metric(r.name, r.value, int(r.time * 1000), r.step) for r in rows]
        for start in range(0, len(metrics), MLFLOW_BATCH_LIMIT):
            self._client.log_batch(
                self._run_id, metrics=metrics[start : start + MLFLOW_BATCH_LIMIT]
            )

    def _start(self) -> None:
        from mlflow.tracking import MlflowClient

        if self.tracking_uri.startswith("file:"):
            # MLflow 3 refuses its file store unless asked (it recommends a database, which
            # mlflow-skinny cannot open); a local directory per run is what this default is for.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = client.get_experiment_by_name(self.experiment)
        experiment_id = (
            experiment.experiment_id if experiment else client.create_experiment(self.experiment)
        )
        run_id = self.run_tags["rollout.run_id"]
        earlier = client.search_runs(
            [experiment_id], filter_string=f"tags.`rollout.run_id` = '{run_id}'", max_results=1
        )
        if earlier:
            self._run_id = earlier[0].info.run_id
            client.update_run(self._run_id, status="RUNNING")
        else:
            run = client.create_run(experiment_id, run_name=run_id, tags=self.run_tags)
            self._run_id = run.info.run_id
        self._client = client
        log.info(
            "mlflow run %s in experiment %r at %s", self._run_id, self.experiment, self.tracking_uri
        )

    def close(self) -> None:
        if self._client is not None:
            self._client.set_terminated(self._run_id)
            self._client = None


def tracking_uri(configured: str | None, base_dir: Path, run_dir: Path) -> str:
    """The MLflow tracking URI: the configured one, a local path made a file: URI (relative to the
    config's directory), or the run directory's file store."""
    if configured is None:
        return (run_dir / MLFLOW_DIR).resolve().as_uri()
    if configured == "databricks" or urlsplit(configured).scheme:
        return configured
    path = Path(configured).expanduser()
    return (path if path.is_absolute() else base_dir / path).resolve().as_uri()


# --- shared


def _by_step(rows: Sequence[MetricRecord]) -> Iterator[tuple[int, dict[str, float]]]:
    for step, group in itertools.groupby(rows, key=lambda row: row.step):
        yield step, {row.name: row.value for row in group}


TRACKERS: dict[str, Callable[[Plan], Tracker]] = {
    "jsonl": JsonlTracker.from_plan,
    "tensorboard": TensorBoardTracker.from_plan,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}
"""Worker-side trackers by their [logging] name."""

HOST_TRACKERS = frozenset({"console"})
"""Trackers the host draws from the run store; workers have nothing to do for them."""


class PluginTracker:
    """A tracker plugin ([logging] trackers = ["my_pkg.trackers:make"], a file or an entry
    point), resolved at plan time. Built on its first rows, on the sink's thread, as every
    tracker opens: `factory(run_id=..., run_dir=...)` returns an object with `log(rows)` and
    `close()`. A factory that raises, or returns something else, is disabled like a tracker
    that fails: one warning naming it, and the run goes on."""

    def __init__(self, identity: PluginIdentity, run_id: str, run_dir: str):
        self.name = identity.ref
        self.identity = identity
        self.run_id, self.run_dir = run_id, run_dir
        self._tracker: Any = None

    def log(self, rows: Sequence[MetricRecord]) -> None:
        if self._tracker is None:
            self._tracker = self._build()
        self._tracker.log(rows)

    def close(self) -> None:
        if self._tracker is not None:
            self._tracker.close()

    def _build(self) -> Any:
        from rollout.plugins.resolve import load_plugin

        built = load_plugin(self.identity)(run_id=self.run_id, run_dir=self.run_dir)
        problem = not_a_tracker(built)
        if problem:
            raise TypeError(f"{self.identity.used_by} = {self.name!r} {problem}: {TRACKER_SHAPE}")
        return built


TRACKER_SHAPE = "a tracker plugin returns an object with log(rows) and close()"


def not_a_tracker(built: Any) -> str | None:
    """What a tracker factory's result lacks ("returned a dict, which has no log() or
    close()"), or None when it has both: one check for a run's trackers and `rollout plugins
    test`."""
    missing = [name for name in ("log", "close") if not callable(getattr(built, name, None))]
    if not missing:
        return None
    lacks = " or ".join(f"{name}()" for name in missing)
    return f"returned a {type(built).__name__}, which has no {lacks}"


def build_trackers(plan: Plan) -> list[Tracker]:
    """The plan's worker-side trackers, in their configured order (nothing opens yet)."""
    plugins = {identity.ref: identity for identity in plan.trackers}
    trackers: list[Tracker] = []
    for name in plan.config.logging.trackers:
        if name in HOST_TRACKERS:
            continue
        if name in TRACKERS:
            trackers.append(TRACKERS[name](plan))
        else:
            run_dir = plan.derived.run_dir
            trackers.append(PluginTracker(plugins[name], plan.run_id, run_dir))
    return trackers


def metric_sinks(plan: Plan, rank: int) -> list[MetricSink]:
    """What a worker's store writer feeds: the recording rank's trackers (rank 0, or the first
    learner of a disaggregated run), behind one `TrackerSink`; nothing on other ranks (that
    rank writes every metric) or when no worker-side tracker is configured."""
    trackers = build_trackers(plan) if rank == recording_rank(plan.graph) else []
    return [TrackerSink(trackers)] if trackers else []


class TrackerSink:
    """A `MetricSink` that hands rows to trackers on a thread of its own."""

    name = "trackers"

    def __init__(self, trackers: Sequence[Tracker], *, close_timeout_s: float = CLOSE_TIMEOUT_S):
        self._trackers = list(trackers)
        self._close_timeout_s = close_timeout_s
        self._queue: queue.SimpleQueue[tuple[MetricRecord, ...] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="rollout-trackers", daemon=True)
        self._thread.start()

    def log(self, rows: Sequence[MetricRecord]) -> None:
        self._queue.put(tuple(rows))

    def close(self) -> None:
        """Deliver what is queued, close every tracker; wait at most `close_timeout_s` for it."""
        self._queue.put(None)
        self._thread.join(self._close_timeout_s)
        if self._thread.is_alive():
            names = ", ".join(tracker.name for tracker in self._trackers)
            log.warning(
                "trackers (%s) still busy %.0f s after the run ended: left unfinished",
                names,
                self._close_timeout_s,
            )

    def _run(self) -> None:
        while (rows := self._next()) is not None:
            for tracker in list(self._trackers):
                try:
                    tracker.log(rows)
                except Exception as error:
                    self._disable(tracker, error)
        for tracker in self._trackers:
            try:
                tracker.close()
            except Exception as error:
                log.warning("tracker %s failed to close: %s", tracker.name, _describe(error))

    def _next(self) -> tuple[MetricRecord, ...] | None:
        """The next rows, joined with any others already waiting (one write for a tracker that
        fell behind); None when closing and nothing is left before the close."""
        rows = self._queue.get()
        if rows is None:
            return None
        while True:
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                return rows
            if more is None:
                self._queue.put(None)  # seen again once these rows are delivered
                return rows
            rows += more

    def _disable(self, tracker: Tracker, error: Exception) -> None:
        self._trackers.remove(tracker)
        log.warning(
            "tracker %s failed and is disabled for the rest of this run (training goes on): %s",
            tracker.name,
            _describe(error),
        )
        with contextlib.suppress(Exception):  # its failure is reported once, above
            tracker.close()


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
