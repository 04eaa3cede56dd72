"""`rollout run` with every worker-side tracker on: each one's own reader finds exactly the rows the
run store holds (names, steps, values), and `logging.interval` thins the training steps.

Drives the CLI in a subprocess on the tiny model for 2 steps, W&B in offline mode; about a minute.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.storage import open_store
from rollout.testing.tracker_output import (
    read_jsonl,
    read_mlflow,
    read_tensorboard,
    read_wandb,
)
from tests.conftest import EXAMPLES

pytestmark = pytest.mark.slow

FAKE_KEY = "f" * 40  # read by the worker at run time; must reach no file

# A tracker plugin ([logging] trackers = ["./tracker.py:make"]): each row as a JSON line.
PLUGIN_TRACKER = """
import json
import os


class Lines:
    def __init__(self, run_id, run_dir):
        self.path = os.path.join(run_dir, "plugin-metrics.jsonl")

    def log(self, rows):
        with open(self.path, "a") as file:
            for row in rows:
                file.write(json.dumps([row.name, row.step, row.value]) + "\\n")

    def close(self):
        pass


def make(run_id, run_dir):
    return Lines(run_id, run_dir)
"""


def run_with_trackers(tmp_path: Path) -> subprocess.CompletedProcess:
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    (tmp_path / "examples" / "tracker.py").write_text(PLUGIN_TRACKER)
    env = {
        **os.environ,
        "ROLLOUT_CACHE": str(tmp_path / "cache"),
        "COLUMNS": "200",
        "WANDB_MODE": "offline",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "ROLLOUT_TEST_WANDB_KEY": FAKE_KEY,
    }
    overrides = [
        'logging.trackers=["console","jsonl","tensorboard","wandb","mlflow","./tracker.py:make"]',
        "logging.wandb_project=rollout-integration",
        "logging.wandb_api_key=env:ROLLOUT_TEST_WANDB_KEY",
        "logging.interval=2",
        "algorithm.max_steps=2",
        "data.eval.limit=4",
    ]
    return subprocess.run(
        [sys.executable, "-m", "rollout", "run", "--config", "examples/grpo-tiny.toml"]
        + [arg for override in overrides for arg in ("--set", override)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_every_tracker_holds_what_the_run_store_holds(tmp_path):
    result = run_with_trackers(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    store = open_store(f"sqlite:{tmp_path / 'runs' / 'rollout.db'}", create=False)
    (record,) = store.list_runs()
    assert record.status == "finished"
    stored: dict[str, list[tuple[int, float]]] = {}
    for row in store.metrics(record.run_id):
        stored.setdefault(row.name, []).append((row.step, row.value))

    # logging.interval = 2: training step 1 is not recorded, step 2 (the last) is; evaluation
    # runs before training (step 0) and at the end.
    assert {step for step, _ in stored["reward/mean"]} == {2}
    assert [step for step, _ in stored["eval/reward"]] == [0, 2]
    assert any(name.startswith("train/") for name in stored)

    run_dir = tmp_path / "runs" / record.run_id
    assert sorted_series(read_jsonl(run_dir / "metrics.jsonl")) == sorted_series(stored)
    board = by_point(read_tensorboard(run_dir / "tensorboard"))
    expected = by_point(stored)
    assert board.keys() == expected.keys()
    for key, value in expected.items():  # TensorBoard keeps float32
        assert board[key] == (value if value is None else pytest.approx(value, rel=1e-6)), key

    wandb_run = read_wandb(run_dir)
    assert (wandb_run.project, wandb_run.run_id) == ("rollout-integration", record.run_id)
    assert sorted_series(wandb_run.history) == sorted_series(stored)

    mlflow_runs = read_mlflow((run_dir / "mlruns").as_uri(), "grpo-tiny")
    assert sorted_series(mlflow_runs[record.run_id]) == sorted_series(stored)

    lines = (run_dir / "plugin-metrics.jsonl").read_text().splitlines()
    plugin_rows = [json.loads(line) for line in lines]
    assert sorted_series(series_of(plugin_rows)) == sorted_series(stored)

    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and FAKE_KEY.encode() in p.read_bytes()]
    assert leaked == []
    failures = [log.message for log in store.logs(record.run_id) if "tracker" in log.message]
    assert [m for m in failures if "failed" in m or "busy" in m] == []


def series_of(rows: list[list]) -> dict[str, list[tuple[int, float | None]]]:
    series: dict[str, list[tuple[int, float | None]]] = {}
    for name, step, value in rows:
        series.setdefault(name, []).append((step, value))
    return series


def sorted_series(series: dict) -> list[tuple[str, int, float | None]]:
    """(name, step, value) rows in one order, whichever reader produced them; NaN as None (what
    metrics.jsonl writes), so that equal series compare equal."""
    return sorted(
        (name, step, None if value is None or math.isnan(value) else value)
        for name, points in series.items()
        for step, value in points
    )


def by_point(series: dict) -> dict[tuple[str, int], float | None]:
    return {(name, step): value for name, step, value in sorted_series(series)}
