"""`rollout runs` and `rollout logs` as a user meets them: tables, filters, follow, clear errors;
the same on a SQLite and a Postgres run store."""

from __future__ import annotations

import json
import threading
import time

import pytest
from typer.testing import CliRunner

from rollout.cli import logs as logs_cli
from rollout.cli.app import app
from rollout.errors import RolloutError
from rollout.executor.ownership import Owner
from rollout.storage import open_store
from rollout.storage.base import CheckpointRecord, MetricRecord

runner = CliRunner()
RUN = "grpo-tiny-20260101-000000-abc123"
FAILED = "grpo-tiny-20260102-000000-def456"
OWNER = Owner.this_process()
TRACEBACK = 'rank-0: Traceback (most recent call last):\n  File "x.py"\nValueError: reward is NaN'


@pytest.fixture
def location(store_location):
    """A store with a running run (metrics, logs, a checkpoint) and a failed one."""
    location = store_location
    with open_store(location) as store:
        for run_id in (RUN, FAILED):
            store.create_run(
                run_id, name="grpo-tiny", plan_sha256="x", plan_path="/p/plan.lock", run_dir="/p"
            )
            # Owned by this (live) process, with a lease that outlasts the test.
            store.claim_run(run_id, OWNER.to_json(), lease_s=3600)
        store.set_status(FAILED, "failed", error=TRACEBACK)
        now = time.time()
        store.add_metrics(
            MetricRecord(RUN, step, "reward/mean", step / 10, now) for step in range(4)
        )
        store.add_checkpoint(CheckpointRecord(RUN, 2, "/p/checkpoints/step-2", now))
        store.add_logs(
            [
                (RUN, now, "debug", 0, "learner", "tokenizer loaded"),
                (RUN, now, "info", 0, "actor+learner", "step 1 [done]"),
                (RUN, now, "warning", 1, "actor", "slow reward"),
                (RUN, now, "error", 1, "learner", "oom, retrying"),
            ]
        )
    return location


def invoke(*args, env=None):
    # A wide terminal, so table cells are never folded in the assertions below.
    return runner.invoke(app, list(args), env={"COLUMNS": "200", **(env or {})})


# --- runs


def test_runs_list_table(location):
    result = invoke("runs", "list", "--store", location)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert " ".join(lines[0].split()) == "id status started duration last step error"
    assert lines[1].startswith(FAILED) and "failed" in lines[1]
    assert lines[1].rstrip().endswith("ValueError: reward is NaN")
    assert lines[2].startswith(RUN) and "running" in lines[2] and " 3 " in lines[2]


def test_runs_list_status_filter_and_json(location):
    result = invoke("runs", "list", "--store", location, "--status", "failed", "--format", "json")
    assert result.exit_code == 0, result.output
    runs = json.loads(result.output)["runs"]
    assert [run["run_id"] for run in runs] == [FAILED]
    assert runs[0]["error"] == TRACEBACK and runs[0]["ended_at"] is not None
    empty = invoke("runs", "list", "--store", location, "--status", "stopped")
    assert empty.exit_code == 0 and "no runs with status stopped" in empty.output


def test_runs_list_default_store_from_the_environment(location):
    result = invoke("runs", "list", "--format", "json", env={"ROLLOUT_STORE": location})
    assert len(json.loads(result.output)["runs"]) == 2


def test_runs_show_running(location):
    result = invoke("runs", "show", RUN, "--store", location)
    assert result.exit_code == 0, result.output
    assert "status     running" in result.output
    assert "plan       /p/plan.lock" in result.output
    assert "reward/mean 3 0.3" in " ".join(result.output.split())
    assert "checkpoint  step 2: /p/checkpoints/step-2" in result.output


def test_runs_show_failed_prints_the_traceback(location):
    result = invoke("runs", "show", FAILED, "--store", location)
    assert result.exit_code == 0, result.output
    assert "Traceback (most recent call last)" in result.output
    assert result.output.rstrip().endswith("ValueError: reward is NaN")


def test_runs_show_json(location):
    result = invoke("runs", "show", RUN, "--store", location, "--format", "json")
    report = json.loads(result.output)
    assert report["metrics"] == {"reward/mean": {"step": 3, "value": 0.3}}
    assert report["checkpoint"]["step"] == 2 and report["last_step"] == 3


def test_runs_cancel(location):
    result = invoke("runs", "cancel", RUN, "--store", location)
    assert result.exit_code == 0, result.output
    assert f"{RUN} will stop at its next step" in result.output
    with open_store(location) as store:
        assert store.get_run(RUN).cancel_requested


def test_cancelling_a_run_that_is_not_running_is_an_error(location):
    result = invoke("runs", "cancel", FAILED, "--store", location)
    assert result.exit_code == 2
    assert "is failed, not running" in result.output


# --- logs


def messages(output):
    return [line.split(maxsplit=3)[3] for line in output.splitlines()]


def test_logs_tail_format(location):
    result = invoke("logs", "tail", RUN, "--store", location)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 4
    clock, level, where, message = lines[1].split(maxsplit=3)
    assert len(clock) == 8 and clock[2] == clock[5] == ":"
    assert (level, where, message) == ("INFO", "0/actor+learner", "step 1 [done]")
    assert lines[2].split()[1:3] == ["WARNING", "1/actor"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--level", "warning"], ["slow reward", "oom, retrying"]),
        (["--level", "ERROR"], ["oom, retrying"]),
        (["--rank", "1"], ["slow reward", "oom, retrying"]),
        (["--role", "learner"], ["tokenizer loaded", "step 1 [done]", "oom, retrying"]),
        (["--role", "actor", "--rank", "0"], ["step 1 [done]"]),
        (["-n", "2"], ["slow reward", "oom, retrying"]),
        (["-n", "0"], []),
    ],
)
def test_logs_tail_filters(location, args, expected):
    result = invoke("logs", "tail", RUN, "--store", location, *args)
    assert result.exit_code == 0, result.output
    assert messages(result.output) == expected


def test_logs_follow_ends_when_the_run_ends(location, monkeypatch):
    monkeypatch.setattr(logs_cli, "POLL_S", 0.02)
    # The run writes only once following has begun: a line written before `-n 1` picked the
    # last one would change which line that is (this made the test fail on a loaded machine).
    following = threading.Event()
    follow = logs_cli._follow

    def follow_and_tell(*args):
        following.set()
        return follow(*args)

    monkeypatch.setattr(logs_cli, "_follow", follow_and_tell)

    def finish_the_run():
        assert following.wait(60)
        with open_store(location) as store:
            for step in range(3):
                time.sleep(0.05)
                store.add_logs([(RUN, time.time(), "info", 0, "learner", f"later {step}")])
            store.set_status(RUN, "finished")

    worker = threading.Thread(target=finish_the_run)
    worker.start()
    result = invoke("logs", "tail", RUN, "--store", location, "--follow", "-n", "1")
    worker.join()
    assert result.exit_code == 0, result.output
    assert messages(result.output) == ["oom, retrying", "later 0", "later 1", "later 2"]


def test_logs_follow_of_a_finished_run_returns_at_once(location):
    result = invoke("logs", "tail", FAILED, "--store", location, "--follow")
    assert result.exit_code == 0 and result.output == ""


def test_ctrl_c_while_following_exits_quietly(location, monkeypatch):
    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(logs_cli.time, "sleep", interrupted)
    result = invoke("logs", "tail", RUN, "--store", location, "--follow")
    assert result.exit_code == 0
    assert "Aborted" not in result.output and "Traceback" not in result.output


# --- errors


@pytest.mark.parametrize(
    "args",
    [["runs", "show"], ["runs", "cancel"], ["logs", "tail"]],
)
def test_unknown_run_suggests_known_ids(location, args):
    result = invoke(*args, RUN[:-1], "--store", location)
    assert result.exit_code == 2
    assert f"no run '{RUN[:-1]}' in {location}" in result.output
    assert f"did you mean '{RUN}'" in result.output


@pytest.mark.parametrize("bad", ["../etc", "a/b", "a\\b", "two words"])
def test_path_like_run_ids_fail_before_the_store_is_touched(tmp_path, bad):
    missing = tmp_path / "never" / "rollout.db"
    result = invoke("logs", "tail", bad, "--store", f"sqlite:{missing}")
    assert result.exit_code == 2
    assert "a run id has no '/'" in result.output
    assert not missing.parent.exists()


@pytest.mark.parametrize(
    "args",
    [["runs", "list"], ["runs", "show", RUN], ["logs", "tail", RUN], ["runs", "cancel", RUN]],
)
def test_a_missing_store_is_named_and_not_created(tmp_path, args):
    missing = tmp_path / "runs" / "rollout.db"
    result = invoke(*args, "--store", f"sqlite:{missing}")
    assert result.exit_code == 2
    assert f"{missing}: no run store here" in result.output
    assert "Traceback" not in result.output
    assert not missing.exists()


def test_the_default_store_is_under_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("runs", "list", env={"ROLLOUT_STORE": ""})
    assert result.exit_code == 2
    assert f"{tmp_path.resolve() / 'runs' / 'rollout.db'}: no run store here" in result.output


@pytest.mark.parametrize(
    "args",
    [["runs", "list"], ["runs", "show", RUN], ["logs", "tail", RUN], ["runs", "cancel", RUN]],
)
def test_an_empty_postgres_schema_is_no_store_and_stays_empty(postgres_location, args):
    result = invoke(*args, "--store", postgres_location)
    assert result.exit_code == 2, result.output
    assert f"{postgres_location}: no run store here" in result.output
    assert "has no rollout tables" in result.output and "Traceback" not in result.output
    with pytest.raises(RolloutError, match="no run store here"):
        open_store(postgres_location, create=False)  # still empty: nothing was created


def test_a_postgres_store_whose_dsn_is_not_set_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("NO_SUCH_DSN", raising=False)
    result = invoke("runs", "list", "--store", "postgres:env:NO_SUCH_DSN")
    assert result.exit_code == 2
    assert "postgres:env:NO_SUCH_DSN: cannot read the DSN" in " ".join(result.output.split())
    assert "environment variable NO_SUCH_DSN is not set" in " ".join(result.output.split())


def test_a_dsn_on_the_command_line_is_refused_and_not_echoed():
    result = invoke("runs", "list", "--store", "postgres://bob:hunter2@db.invalid/runs")
    assert result.exit_code == 2
    assert "never the DSN itself" in " ".join(result.output.split())
    assert "hunter2" not in result.output


def test_a_postgres_server_that_does_not_answer_is_named_without_its_password(monkeypatch):
    monkeypatch.setenv("DEAD_DSN", "host=127.0.0.1 port=9 dbname=runs user=bob password=hunter2")
    result = invoke("runs", "list", "--store", "postgres:env:DEAD_DSN")
    assert result.exit_code == 2
    output = " ".join(result.output.split())
    assert "cannot connect to the postgres run store postgres:env:DEAD_DSN" in output
    assert "database runs on 127.0.0.1:9 as bob" in output
    assert "hunter2" not in result.output and "Traceback" not in result.output


def test_sparkline_spans_lowest_to_highest():
    from rollout.cli.runs import sparkline

    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([2.0, 2.0]) == "▁▁"
    long = sparkline([float(i) for i in range(100)], width=10)
    assert len(long) == 10 and long[0] == "▁" and long[-1] == "█"
