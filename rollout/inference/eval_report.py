"""What `rollout eval` found: the JSON report of every suite's results (written whole or not at
all), and the scores recorded in the run store as metrics of a run's checkpoint."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from rollout.errors import Issue, RolloutError
from rollout.harness.eval.results import SuiteResult, metric_names
from rollout.inference.model_choice import ModelChoice

REPORT_FORMAT = 1


def build_report(
    choice: ModelChoice, seed: int, templated: bool, results: list[SuiteResult], seconds: float
) -> dict[str, Any]:
    return {
        "format": REPORT_FORMAT,
        "model": choice.description,
        "model_fingerprint": choice.facts.fingerprint,
        "seed": seed,
        "chat_template": templated,
        "seconds": round(seconds, 3),
        "suites": [
            {
                "name": result.name,
                "scorer": result.scorer,
                "scorer_plugin": result.plugin,
                "data": result.data,
                "n": len(result.rows),
                "samples": result.samples,
                "k": result.ks,
                "settings": result.settings,
                "metrics": result.summary,
                "categories": {
                    name: {"n": count, "metrics": metrics}
                    for name, (count, metrics) in result.categories.items()
                },
                "rows": result.rows,
            }
            for result in results
        ],
    }


def check_report_path(path: Path) -> None:
    if path.is_dir():
        raise RolloutError(Issue("--report", f"{path} is a directory", hint="name a .json file"))


def write_report(path: Path, report: dict[str, Any]) -> None:
    """The report as JSON, written whole or not at all (a temporary file, then renamed)."""
    path = Path(path)
    check_report_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=1)
            file.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


# --- the run store -------------------------------------------------------------------------------


def recording_step(run: str, store_location: str | None, choice: ModelChoice) -> int:
    """The step to record at: the checkpoint's, which must be of run `run`; the run must be in
    the store. Checked before any weights load."""
    from rollout.storage import check_run_id, default_store_location, find_run, open_store

    if choice.checkpoint is None:
        raise RolloutError(
            Issue(
                "--run",
                "records the scores at a checkpoint's step, and no --checkpoint is given",
                hint=f"pass --checkpoint {run} (its latest) or a checkpoint directory of it",
            )
        )
    if choice.checkpoint_run is not None and choice.checkpoint_run != run:
        raise RolloutError(
            Issue(
                "--run",
                f"the checkpoint {choice.checkpoint} belongs to run {choice.checkpoint_run}",
                value=run,
                hint=f"--run {choice.checkpoint_run}, or a checkpoint of run {run}",
            )
        )
    check_run_id(run)
    location = store_location or default_store_location()
    store = open_store(location, create=False)
    try:
        find_run(store, run, location)
    finally:
        store.close()
    return int(choice.checkpoint.name.removeprefix("step-"))


def record_metrics(
    run: str, store_location: str | None, step: int, results: list[SuiteResult]
) -> int:
    """Write every suite's scores as metrics of `run` at `step`; how many were written."""
    from rollout.storage import default_store_location, open_store
    from rollout.storage.base import MetricRecord

    now = time.time()
    rows = [
        MetricRecord(run_id=run, step=step, name=name, value=value, time=now)
        for result in results
        for name, value in metric_names(result).items()
    ]
    store = open_store(store_location or default_store_location(), create=False)
    try:
        store.add_metrics(rows)
    finally:
        store.close()
    return len(rows)
