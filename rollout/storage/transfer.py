"""A run's records as plain files, and back into any store: how a run moves between backends.

    <directory>/run.json            the run's row (RunRecord's fields)
    <directory>/metrics.jsonl       one MetricRecord per line, by name then step (NaN as null)
    <directory>/logs.jsonl          one LogRecord per line, in id order
    <directory>/checkpoints.jsonl   one CheckpointRecord per line, by step
    <directory>/samples.jsonl       one SampleRecord per line, by step and index (NaN reward as
                                    null); absent from exports made before samples were recorded

JSON only (never pickle): the files are read on another machine, by another version. Exported
records stop at a step: a snapshot holds the checkpoint of step N and the records up to it, and
the run that continues from N writes the later ones again. Importing writes every row in one
transaction, under a new run id, so a target store holds the whole run or none of it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from rollout.storage.base import (
    CheckpointRecord,
    LogRecord,
    MetricRecord,
    RunRecord,
    RunStore,
    SampleRecord,
)

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
LOGS_FILE = "logs.jsonl"
CHECKPOINTS_FILE = "checkpoints.jsonl"
SAMPLES_FILE = "samples.jsonl"
_PAGE = 10_000


@dataclass(frozen=True)
class RunRecords:
    """Everything a store keeps of one run."""

    run: RunRecord
    metrics: list[MetricRecord]
    logs: list[LogRecord]
    checkpoints: list[CheckpointRecord]
    samples: list[SampleRecord] = field(default_factory=list)
    """Sample completions travel with the run, so its report can be made in the new store."""

    def counts(self) -> str:
        return (
            f"{len(self.metrics)} metric values, {len(self.logs)} log lines, "
            f"{len(self.checkpoints)} checkpoint records, {len(self.samples)} samples"
        )


def read_records(
    store: RunStore, run: RunRecord, *, up_to_step: int, logs_until: float
) -> RunRecords:
    """`run`'s records of steps 1..`up_to_step`: metrics and checkpoints by their step, log lines
    (which carry no step) by time, up to `logs_until`."""
    metrics = [m for m in store.metrics(run.run_id) if m.step <= up_to_step]
    checkpoints = [c for c in store.checkpoints(run.run_id) if c.step <= up_to_step]
    logs = [line for line in _all_logs(store, run.run_id) if line.time <= logs_until]
    samples = [s for s in store.samples(run.run_id) if s.step <= up_to_step]
    return RunRecords(run, metrics, logs, checkpoints, samples)


def _all_logs(store: RunStore, run_id: str) -> Iterator[LogRecord]:
    after = 0
    while page := store.logs(run_id, after_id=after, limit=_PAGE):
        yield from page
        after = page[-1].id


def write_records(records: RunRecords, directory: Path) -> list[Path]:
    """The five files under `directory` (created); their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    run_file = directory / RUN_FILE
    run_file.write_text(json.dumps(asdict(records.run), indent=2, sort_keys=True) + "\n")
    written = [run_file]
    for name, rows in (
        (METRICS_FILE, [_metric_row(m) for m in records.metrics]),
        (LOGS_FILE, [asdict(line) for line in records.logs]),
        (CHECKPOINTS_FILE, [asdict(c) for c in records.checkpoints]),
        (SAMPLES_FILE, [_sample_row(s) for s in records.samples]),
    ):
        path = directory / name
        with path.open("w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, sort_keys=True, allow_nan=False) + "\n")
        written.append(path)
    return written


def load_records(directory: Path) -> RunRecords:
    """What write_records wrote; ValueError naming the file and line of anything else."""
    run = _record(RunRecord, _json(directory / RUN_FILE, 0, (directory / RUN_FILE).read_text()))
    metrics = [
        _record(MetricRecord, {**row, "value": math.nan if row["value"] is None else row["value"]})
        for row in _lines(directory / METRICS_FILE)
    ]
    logs = [_record(LogRecord, row) for row in _lines(directory / LOGS_FILE)]
    checkpoints = [_record(CheckpointRecord, row) for row in _lines(directory / CHECKPOINTS_FILE)]
    samples = []
    if (directory / SAMPLES_FILE).exists():
        samples = [
            _record(SampleRecord, {**row, "reward": _nan_if_none(row.get("reward"))})
            for row in _lines(directory / SAMPLES_FILE)
        ]
    return RunRecords(run, metrics, logs, checkpoints, samples)


def import_records(
    store: RunStore,
    records: RunRecords,
    *,
    run_id: str,
    plan_sha256: str,
    plan_path: str,
    run_dir: str,
    checkpoint: CheckpointRecord | None,
) -> None:
    """Create run `run_id` in `store` holding `records` (their run id rewritten), in one
    transaction. The old checkpoint records are replaced by `checkpoint`, the one the new run
    owns: the others name files of the old run. A RolloutError if `run_id` exists already."""
    with store.transaction():
        store.create_run(
            run_id,
            name=records.run.name,
            plan_sha256=plan_sha256,
            plan_path=plan_path,
            run_dir=run_dir,
        )
        store.add_metrics(
            MetricRecord(run_id, m.step, m.name, m.value, m.time) for m in records.metrics
        )
        store.add_logs(
            (run_id, line.time, line.level, line.rank, line.role, line.message)
            for line in records.logs
        )
        store.add_samples(
            SampleRecord(
                run_id, s.step, s.index, s.prompt, s.completion, s.turns, s.reward, s.extra, s.time
            )
            for s in records.samples
        )
        if checkpoint is not None:
            store.add_checkpoint(checkpoint)


def _metric_row(metric: MetricRecord) -> dict[str, Any]:
    row = asdict(metric)
    if math.isnan(row["value"]):
        row["value"] = None  # JSON has no NaN; the stores read NULL back as NaN too
    return row


def _sample_row(sample: SampleRecord) -> dict[str, Any]:
    """JSON has no NaN: the reward and any non-finite number in `extra` become null."""
    return {**asdict(sample), "reward": _finite(sample.reward), "extra": _finite(sample.extra)}


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def _nan_if_none(value: Any) -> Any:
    return math.nan if value is None else value


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                yield _json(path, number, line)


def _json(path: Path, line: int, text: str) -> dict[str, Any]:
    try:
        row = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{path.name} line {line}: not JSON ({error})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path.name} line {line}: not a JSON object")
    return row


def _record(kind: type, row: dict[str, Any]) -> Any:
    names = {f.name for f in fields(kind)}
    if not names >= set(row) or not {f.name for f in fields(kind) if _required(f)} <= set(row):
        raise ValueError(f"not a {kind.__name__}: fields {sorted(row)}")
    return kind(**row)


def _required(field: Any) -> bool:
    return field.default is MISSING and field.default_factory is MISSING
