"""`rollout run` on each run-store backend, as a user drives it: a real run of grpo-tiny recording
into SQLite or Postgres, then `runs list/show` and `logs tail` against that store, with the same
output on both; and a run killed mid-step and resumed, whose redone steps keep one metric row.

Each run starts Python and torch twice (host and worker): marked slow, as CI runs them.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from rollout.errors import RolloutError
from rollout.storage import open_store
from tests.conftest import STORE_DSN_ENV
from tests.integration.driver import environment, processes_mentioning, rollout, start

pytestmark = pytest.mark.slow


def store_settings(location: str) -> list[str]:
    """--set pairs that make grpo-tiny record into the store at `location`."""
    if location.startswith("postgres:"):
        backend = ["storage.backend=postgres", f"storage.postgres_dsn=env:{STORE_DSN_ENV}"]
    else:
        backend = [f"storage.sqlite_path={location.removeprefix('sqlite:')}"]
    return [arg for setting in backend for arg in ("--set", setting)]


def test_a_run_records_into_either_store_and_the_cli_reads_it_the_same(workdir, store_location):
    result = rollout(
        workdir,
        "run",
        "--config",
        "examples/grpo-tiny.toml",
        *("--set", "algorithm.max_steps=3", "--set", "checkpoint.interval=2"),
        *("--set", "data.eval.limit=8"),
        *store_settings(store_location),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    with open_store(store_location, create=False) as store:
        (record,) = store.list_runs()
        assert record.status == "finished" and record.last_step == 3
        steps = [m.step for m in store.metrics(record.run_id, ["reward/mean"])]
        assert steps == [1, 2, 3]
        assert [c.step for c in store.checkpoints(record.run_id)] == [2, 3]
    run_id = record.run_id

    listed = rollout(workdir, "runs", "list", "--store", store_location)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == ["id", "status", "started", "duration", "last", "step", "error"]
    assert row.split()[:2] == [run_id, "finished"] and row.split()[-1] == "3"

    shown = rollout(workdir, "runs", "show", run_id, "--store", store_location)
    assert shown.returncode == 0, shown.stderr
    assert "status     finished" in shown.stdout and "last step  3" in shown.stdout
    assert "reward/mean" in shown.stdout and "checkpoint  step 3:" in shown.stdout

    # $ROLLOUT_STORE names it as well as --store does.
    env = {**environment(workdir), "ROLLOUT_STORE": store_location}
    logs = subprocess.run(
        [sys.executable, "-m", "rollout", "logs", "tail", run_id, "-n", "100", "--follow"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert logs.returncode == 0, logs.stderr
    assert "training grpo for steps 1..3" in logs.stdout
    assert "step 3/3: reward " in logs.stdout
    if store_location.startswith("postgres:"):
        assert "host=" not in shown.stdout + listed.stdout + logs.stdout + result.stdout


def test_a_resumed_run_keeps_one_row_per_metric_and_step(workdir, store_location):
    """The host is killed (SIGKILL) after step 3 was recorded but before a checkpoint covers
    it: the resume redoes step 3 from the step-2 checkpoint and writes its metrics again."""
    host = start(
        workdir,
        "run",
        "--config",
        "examples/grpo-tiny.toml",
        *("--set", "algorithm.max_steps=4", "--set", "checkpoint.interval=2"),
        *("--set", "data.eval=null", "--set", "rewards=[{ fn = './slow.py:slow' }]"),
        *store_settings(store_location),
    )
    run_id = wait_for_step(store_location, 3, host)
    host.send_signal(signal.SIGKILL)
    host.communicate(timeout=60)
    killed_at = time.time()
    deadline = time.monotonic() + 10
    while processes_mentioning(str(workdir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    with open_store(store_location, create=False) as store:
        assert [c.step for c in store.checkpoints(run_id)] == [2]
        before = {(m.name, m.step) for m in store.metrics(run_id)}
    assert ("reward/mean", 3) in before

    plan = workdir / "runs" / run_id / "plan.lock"
    resumed = rollout(workdir, "run", "--plan", str(plan))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming" in resumed.stdout
    with open_store(store_location, create=False) as store:
        metrics = store.metrics(run_id)
        assert store.get_run(run_id).status == "finished"
    keys = [(m.name, m.step) for m in metrics]
    assert len(keys) == len(set(keys)), "a redone step's metrics were stored twice"
    assert sorted({m.step for m in metrics if m.name == "reward/mean"}) == [1, 2, 3, 4]
    redone = next(m for m in metrics if (m.name, m.step) == ("reward/mean", 3))
    assert redone.time > killed_at  # the redone step's row won


def wait_for_step(location: str, step: int, process: subprocess.Popen) -> str:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        try:
            with open_store(location, create=False) as store:
                runs = store.list_runs()
        except RolloutError:  # the run has not created its store yet
            runs = []
        if runs and (runs[0].last_step or 0) >= step:
            return runs[0].run_id
        time.sleep(0.1)
    raise AssertionError(f"the run did not reach step {step} within 240 s")
