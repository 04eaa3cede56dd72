"""[logging] trackers: each writes what its own reader reads back (values and steps), a failing
tracker is disabled with one warning, packages are checked at plan time, and options of a tracker
that is not enabled are refused."""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
import time
from pathlib import Path

import pytest

from rollout import ConfigError, PlanError
from rollout.config import validate_config
from rollout.planner.builder import build_plan
from rollout.planner.definition import HardwareFacts
from rollout.runtime.trackers import (
    JsonlTracker,
    MlflowTracker,
    TensorBoardTracker,
    TrackerSink,
    WandbTracker,
    build_trackers,
    metric_sinks,
    read_secret,
    tracking_uri,
)
from rollout.storage.base import MetricRecord
from rollout.testing.tracker_output import (
    read_jsonl,
    read_mlflow,
    read_tensorboard,
    read_wandb,
)

LAPTOP = HardwareFacts(
    platform="test", cpu_count=8, memory_bytes=16 * 1024**3, memory_available_bytes=12 * 1024**3
)
FAKE_KEY = "k" * 40  # never a real key: it must not reach any file


def rows(step: int, **values: float) -> list[MetricRecord]:
    return [
        MetricRecord("run", step, name.replace("__", "/"), value, 1_700_000_000.0 + step)
        for name, value in values.items()
    ]


# Three batches as the store writer hands them over: evaluation before training, two steps.
BATCHES = [
    rows(0, eval__reward=0.5),
    rows(1, train__loss=1.25, reward__mean=0.75),
    rows(2, train__loss=1.0, reward__mean=0.875, eval__reward=0.625),
]
EXPECTED = {
    "eval/reward": [(0, 0.5), (2, 0.625)],
    "train/loss": [(1, 1.25), (2, 1.0)],
    "reward/mean": [(1, 0.75), (2, 0.875)],
}


def feed(tracker, batches=BATCHES) -> None:
    for batch in batches:
        tracker.log(batch)
    tracker.close()


@pytest.fixture
def make_plan(config_file, base_config, tmp_path):
    def make(**logging_section):
        config = {**base_config, "logging": logging_section}
        config["run"] = {**config["run"], "output_dir": str(tmp_path / "runs")}
        return build_plan(config_file(config), hardware=LAPTOP)

    return make


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings():
    """Warnings of the rollout.trackers logger (caught on it: a worker stops propagation)."""
    handler = Warnings()
    logger = logging.getLogger("rollout.trackers")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


# --- jsonl


def test_jsonl_appends_one_object_per_metric_row(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    feed(JsonlTracker(path))
    assert read_jsonl(path) == EXPECTED
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"step": 0, "name": "eval/reward", "value": 0.5, "time": 1_700_000_000.0}


def test_jsonl_is_readable_after_every_batch_and_appends_across_attempts(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tracker = JsonlTracker(path)
    tracker.log(BATCHES[0])
    assert read_jsonl(path) == {"eval/reward": [(0, 0.5)]}  # on disk before close
    tracker.close()
    feed(JsonlTracker(path), [rows(1, train__loss=2.0), rows(2, train__loss=float("nan"))])
    assert read_jsonl(path) == {"eval/reward": [(0, 0.5)], "train/loss": [(1, 2.0), (2, None)]}


def test_jsonl_drops_a_partial_last_line_when_reopened(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "name": "a", "value": 1.0, "time": 0}\n{"step": 2, "na')
    feed(JsonlTracker(path), [rows(2, a=2.0)])
    assert read_jsonl(path) == {"a": [(1, 1.0), (2, 2.0)]}


def test_jsonl_a_write_that_fails_part_way_leaves_whole_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tracker = JsonlTracker(path)
    tracker.log(BATCHES[0])

    class DiskFull:
        """Writes 10 bytes, then the disk is full."""

        def __init__(self, file):
            self.file = file
            self.calls = 0

        def write(self, data):
            self.calls += 1
            if self.calls > 1:
                raise OSError(28, "No space left on device")
            return self.file.write(data[:10])

        def __getattr__(self, name):
            return getattr(self.file, name)

    tracker._file = DiskFull(tracker._file)
    with pytest.raises(OSError, match="No space"):
        tracker.log(BATCHES[1])
    tracker.close()
    assert read_jsonl(path) == {"eval/reward": [(0, 0.5)]}


# --- tensorboard


def test_tensorboard_scalars_read_back_with_tensorboard(tmp_path):
    feed(TensorBoardTracker(tmp_path / "tensorboard"))
    assert read_tensorboard(tmp_path / "tensorboard") == EXPECTED  # each exact in float32


def test_tensorboard_a_resumed_run_replaces_the_steps_it_repeats(tmp_path):
    logdir = tmp_path / "tensorboard"
    feed(TensorBoardTracker(logdir), [rows(s, x=float(s)) for s in (1, 2, 3, 4)])
    time.sleep(1.1)  # event files are named by the second they were opened in
    feed(TensorBoardTracker(logdir), [rows(s, x=10.0 * s) for s in (3, 4, 5)])
    assert read_tensorboard(logdir) == {"x": [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]}


# --- wandb


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    """wandb in offline mode, its own config and cache under tmp_path, a fake key in the env."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("ROLLOUT_TEST_WANDB_KEY", FAKE_KEY)
    for variable, folder in (
        ("WANDB_CONFIG_DIR", "wandb-config"),
        ("WANDB_CACHE_DIR", "wandb-cache"),
        ("WANDB_DATA_DIR", "wandb-data"),
    ):
        monkeypatch.setenv(variable, str(tmp_path / folder))


def test_wandb_offline_run_holds_the_history(make_plan, wandb_offline, tmp_path):
    plan = make_plan(
        trackers=["wandb"], wandb_project="rollout-test", wandb_api_key="env:ROLLOUT_TEST_WANDB_KEY"
    )
    feed(WandbTracker(plan))
    run = read_wandb(plan.derived.run_dir)
    assert (run.project, run.name, run.run_id) == ("rollout-test", plan.run_id, plan.run_id)
    assert run.history == EXPECTED
    assert run.config["algorithm"]["kind"] == "grpo"
    assert run.config["logging"]["wandb_api_key"] == "env:ROLLOUT_TEST_WANDB_KEY"
    # The key was read at run time and handed over in memory: no file anywhere holds it.
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and FAKE_KEY.encode() in p.read_bytes()]
    assert leaked == []


# --- mlflow


def test_mlflow_default_file_store_in_the_run_directory(make_plan):
    plan = make_plan(trackers=["mlflow"])
    feed(MlflowTracker(plan))
    uri = (Path(plan.derived.run_dir) / "mlruns").as_uri()
    assert read_mlflow(uri, plan.config.run.name) == {plan.run_id: EXPECTED}


def test_mlflow_a_resumed_run_continues_its_mlflow_run(make_plan, tmp_path):
    plan = make_plan(trackers=["mlflow"], mlflow_experiment="exp", mlflow_tracking_uri="tracking")
    feed(MlflowTracker(plan), [rows(1, x=1.0)])
    feed(MlflowTracker(plan), [rows(2, x=2.0)])
    # A relative tracking URI starts at the config's directory.
    assert read_mlflow((tmp_path / "tracking").as_uri(), "exp") == {
        plan.run_id: {"x": [(1, 1.0), (2, 2.0)]}
    }


def test_tracking_uri(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    assert tracking_uri(None, tmp_path, run_dir) == (run_dir / "mlruns").as_uri()
    assert tracking_uri("mlruns", tmp_path, run_dir) == (tmp_path / "mlruns").as_uri()
    assert tracking_uri("/abs/store", tmp_path, run_dir) == "file:///abs/store"
    for uri in ("http://mlflow:5000", "databricks", "file:///x/y"):
        assert tracking_uri(uri, tmp_path, run_dir) == uri


# --- building, and running them off the hot path


def test_build_trackers_by_name_in_order(make_plan, tmp_path):
    plan = make_plan(trackers=["console", "mlflow", "jsonl", "tensorboard"])
    assert [t.name for t in build_trackers(plan)] == ["mlflow", "jsonl", "tensorboard"]
    assert not list((tmp_path / "runs").glob("*/*")), "nothing opens before the first rows"
    assert metric_sinks(plan, rank=1) == []  # rank 0 writes every metric
    (sink,) = metric_sinks(plan, rank=0)
    sink.close()
    assert metric_sinks(make_plan(trackers=["console"]), rank=0) == []


class Recording:
    def __init__(self, name="recording", gate: threading.Event | None = None):
        self.name = name
        self.rows: list[MetricRecord] = []
        self.closed = 0
        self.gate = gate

    def log(self, rows):
        if self.gate is not None:
            self.gate.wait(10)
        self.rows += rows

    def close(self):
        self.closed += 1


class Broken(Recording):
    def __init__(self, error: Exception):
        super().__init__("broken")
        self.error = error
        self.calls = 0

    def log(self, rows):
        self.calls += 1
        raise self.error


def test_a_failing_tracker_is_disabled_with_one_warning_and_the_others_go_on(warnings):
    broken, healthy = Broken(ConnectionError("network is unreachable")), Recording()
    sink = TrackerSink([broken, healthy])
    for batch in BATCHES:
        sink.log(batch)
    sink.close()
    assert healthy.rows == [row for batch in BATCHES for row in batch] and healthy.closed == 1
    assert broken.calls == 1 and broken.closed == 1
    assert len(warnings) == 1
    assert "broken" in warnings[0] and "ConnectionError: network is unreachable" in warnings[0]


def test_a_tracker_that_fails_to_close_is_reported(warnings):
    class BadClose(Recording):
        def close(self):
            raise OSError("disk full")

    sink = TrackerSink([BadClose("tb")])
    sink.log(BATCHES[0])
    sink.close()
    assert len(warnings) == 1 and "tb" in warnings[0] and "disk full" in warnings[0]


def test_a_slow_tracker_never_holds_up_the_caller():
    gate = threading.Event()
    slow = Recording(gate=gate)
    sink = TrackerSink([slow])
    started = time.monotonic()
    for step in range(200):
        sink.log(rows(step, x=1.0))
    assert time.monotonic() - started < 1.0
    gate.set()
    sink.close()
    assert [row.step for row in slow.rows] == list(range(200))


def test_closing_gives_up_on_a_hung_tracker(warnings):
    hung = Recording("hung", gate=threading.Event())  # never set
    sink = TrackerSink([hung], close_timeout_s=0.2)
    sink.log(BATCHES[0])
    sink.close()
    assert len(warnings) == 1 and "hung" in warnings[0]


def test_read_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("SOME_KEY", "  s3cret\n")
    assert read_secret("env:SOME_KEY") == "s3cret"
    (tmp_path / "key").write_text("from-file\n")
    assert read_secret(f"file:{tmp_path / 'key'}") == "from-file"
    monkeypatch.setenv("EMPTY_KEY", "")
    with pytest.raises(ValueError, match="environment variable EMPTY_KEY is not set"):
        read_secret("env:EMPTY_KEY")


# --- plan and validate time


def test_a_tracker_whose_package_is_missing_is_refused_at_plan_time(make_plan, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def without_wandb(name, *args):
        return None if name == "wandb" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_wandb)
    with pytest.raises(PlanError) as caught:
        make_plan(trackers=["jsonl", "wandb"], wandb_project="p")
    (issue,) = [i for i in caught.value.issues if i.path == "logging.trackers"]
    assert "wandb" in issue.message
    assert "pip install 'rollout[wandb]'" in issue.hint


@pytest.mark.parametrize(
    ("option", "value", "tracker"),
    [
        ("wandb_project", "p", "wandb"),
        ("wandb_api_key", "env:WANDB_API_KEY", "wandb"),
        ("mlflow_tracking_uri", "http://mlflow:5000", "mlflow"),
        ("mlflow_experiment", "exp", "mlflow"),
    ],
)
def test_an_option_of_a_tracker_that_is_not_enabled_is_refused(base_config, option, value, tracker):
    config = {**base_config, "logging": {"trackers": ["console", "jsonl"], option: value}}
    with pytest.raises(ConfigError) as caught:
        validate_config(config)
    issue = next(i for i in caught.value.issues if i.path == f"logging.{option}")
    assert f'add "{tracker}" to logging.trackers' in issue.hint
    config["logging"]["trackers"].append(tracker)
    if tracker == "wandb":
        config["logging"]["wandb_project"] = "p"
    validate_config(config)  # enabled: accepted


# --- tracker plugins ([logging] trackers = ["./tracker.py:make"])

PLUGIN_TRACKER = '''
import json
import os


class LinesTracker:
    """Appends each row to <run_dir>/plugin-rows.jsonl."""

    def __init__(self, run_id, run_dir):
        self.run_id, self.path = run_id, os.path.join(run_dir, "plugin-rows.jsonl")
        os.makedirs(run_dir, exist_ok=True)

    def log(self, rows):
        with open(self.path, "a") as file:
            for row in rows:
                file.write(json.dumps([self.run_id, row.step, row.name, row.value]) + "\\n")

    def close(self):
        with open(self.path, "a") as file:
            file.write("closed\\n")


def make(run_id, run_dir):
    return LinesTracker(run_id, run_dir)


def not_a_tracker(run_id, run_dir):
    return {"run_id": run_id}
'''


def test_a_tracker_plugin_is_resolved_at_plan_and_gets_every_row(make_plan, tmp_path):
    (tmp_path / "tracker.py").write_text(PLUGIN_TRACKER)
    plan = make_plan(trackers=["console", "./tracker.py:make", "jsonl"])
    (identity,) = plan.trackers
    assert (identity.used_by, identity.kind) == ("logging.trackers[1]", "file")
    trackers = build_trackers(plan)
    assert [t.name for t in trackers] == ["./tracker.py:make", "jsonl"]
    sink = TrackerSink(trackers)
    for batch in BATCHES:
        sink.log(batch)
    sink.close()
    lines = (Path(plan.derived.run_dir) / "plugin-rows.jsonl").read_text().splitlines()
    assert lines[-1] == "closed"
    written = [json.loads(line) for line in lines[:-1]]
    expected = [[plan.run_id, r.step, r.name, r.value] for batch in BATCHES for r in batch]
    assert written == expected


def test_an_edited_tracker_plugin_makes_the_plan_stale(make_plan, tmp_path):
    from rollout.planner.lockfile import stale_reasons

    (tmp_path / "tracker.py").write_text(PLUGIN_TRACKER)
    plan = make_plan(trackers=["./tracker.py:make"])
    assert stale_reasons(plan) == []
    (tmp_path / "tracker.py").write_text(PLUGIN_TRACKER + "\n# edited\n")
    (reason,) = stale_reasons(plan)
    assert reason.path == "logging.trackers[0]" and "changed since planning" in reason.message


@pytest.mark.parametrize(
    ("ref", "says"),
    [
        ("./missing.py:make", "missing.py"),
        ("./tracker.py:nothing_here", "nothing_here"),
        ("no_such_tracker_entry_point", "no_such_tracker_entry_point"),
    ],
)
def test_a_tracker_plugin_that_does_not_resolve_is_refused_at_plan(make_plan, tmp_path, ref, says):
    (tmp_path / "tracker.py").write_text(PLUGIN_TRACKER)
    with pytest.raises(PlanError) as caught:
        make_plan(trackers=[ref])
    (issue,) = caught.value.issues
    assert issue.path == "logging.trackers[0]"
    assert says in f"{issue.message} {issue.hint} {issue.value}"


def test_a_tracker_name_close_to_a_built_in_is_a_typo_at_validate(base_config):
    with pytest.raises(ConfigError) as caught:
        validate_config({**base_config, "logging": {"trackers": ["tensorbord"]}})
    (issue,) = caught.value.issues
    assert issue.path == "logging.trackers[0]" and "did you mean 'tensorboard'" in issue.message


def test_a_tracker_factory_returning_no_tracker_is_disabled_naming_it(
    make_plan, tmp_path, warnings
):
    (tmp_path / "tracker.py").write_text(PLUGIN_TRACKER)
    plan = make_plan(trackers=["./tracker.py:not_a_tracker", "jsonl"])
    sink = TrackerSink(build_trackers(plan))
    for batch in BATCHES:
        sink.log(batch)
    sink.close()
    (warning,) = warnings
    assert "./tracker.py:not_a_tracker" in warning and "log() or close()" in warning
    assert read_jsonl(Path(plan.derived.run_dir) / "metrics.jsonl") == EXPECTED  # jsonl went on
