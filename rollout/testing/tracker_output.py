"""Read back what each [logging] tracker wrote, with that tracker's own reader: for tests, and for
anyone checking a run's tracker output. Each returns ``{metric name: [(step, value), ...]}`` in
the order written.

TensorBoard keeps scalars as float32: compare its values with a tolerance.
"""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Series = dict[str, list[tuple[int, float | None]]]

_WANDB_HEADER = b":W&B"
_WANDB_HEADER_SIZE = 7  # ident, magic, version
_LOG_BLOCK = 32768  # the .wandb file is a LevelDB log: records framed in 32 KiB blocks
_LOG_RECORD_HEADER = 7  # crc32, length, type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_jsonl(path: str | Path) -> Series:
    """metrics.jsonl: every line must be whole JSON."""
    series: Series = defaultdict(list)
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        series[row["name"]].append((row["step"], row["value"]))
    return dict(series)


def read_tensorboard(logdir: str | Path) -> Series:
    """Every scalar in the event files of `logdir`, through TensorBoard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        EventAccumulator,
    )

    accumulator = EventAccumulator(str(logdir), size_guidance={SCALARS: 0})  # 0: keep them all
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


@dataclass(frozen=True)
class WandbRun:
    project: str
    name: str
    run_id: str
    history: Series
    config: dict[str, Any]


def read_wandb(directory: str | Path) -> WandbRun:
    """The newest run under `directory`/wandb (offline or synced), from its .wandb transaction
    log, decoded with wandb's own protobuf records."""
    from wandb.proto import wandb_internal_pb2

    files = sorted(Path(directory, "wandb").glob("*run-*/run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no .wandb run file under {Path(directory, 'wandb')}")
    project = name = run_id = ""
    config: dict[str, Any] = {}
    history: Series = defaultdict(list)
    for data in _log_records(files[-1].read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            project, name, run_id = record.run.project, record.run.display_name, record.run.run_id
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "history":
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            step = items.pop("_step")
            for key, value in items.items():
                if not key.startswith("_"):
                    history[key].append((step, value))
    return WandbRun(project, name, run_id, dict(history), config)


def _log_records(data: bytes) -> list[bytes]:
    if not data.startswith(_WANDB_HEADER):
        raise ValueError("not a .wandb file")
    records, pending, position = [], b"", _WANDB_HEADER_SIZE
    while position + _LOG_RECORD_HEADER <= len(data):
        left_in_block = _LOG_BLOCK - position % _LOG_BLOCK
        if left_in_block < _LOG_RECORD_HEADER:  # the block's tail is padding
            position += left_in_block
            continue
        _, length, kind = struct.unpack_from("<IHB", data, position)
        start = position + _LOG_RECORD_HEADER
        chunk, position = data[start : start + length], start + length
        if kind == _FULL:
            records.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            records.append(pending + chunk)
        else:
            break  # zeros: the writer stopped here
    return records


def read_mlflow(tracking_uri: str, experiment: str) -> dict[str, Series]:
    """Every run of `experiment`, by its rollout.run_id tag, through MlflowClient."""
    import os

    from mlflow.tracking import MlflowClient

    if tracking_uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise LookupError(f"no MLflow experiment {experiment!r} at {tracking_uri}")
    runs: dict[str, Series] = {}
    for run in client.search_runs([found.experiment_id]):
        runs[run.data.tags.get("rollout.run_id", run.info.run_id)] = {
            name: [
                (metric.step, metric.value)
                for metric in sorted(
                    client.get_metric_history(run.info.run_id, name),
                    key=lambda m: (m.step, m.timestamp),
                )
            ]
            for name in run.data.metrics
        }
    return runs
