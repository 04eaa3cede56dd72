"""`rollout run` as a user sees it, with the executor replaced: a failure's text as written (no
markup eaten), no empty summary, one plain line per step when output is not a terminal."""

from __future__ import annotations

import io
import time

from rich.console import Console
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.cli.progress import RunView
from rollout.executor import launch
from rollout.planner.builder import build_plan
from rollout.planner.lockfile import write_plan
from rollout.storage import open_store
from rollout.storage.base import MetricRecord

runner = CliRunner()
TRACEBACK = (
    "rank-0: Traceback (most recent call last):\n"
    '  File "r.py", line 3, in score\n'
    "    return [scores[0]] * len([bold]completions)\n"
    "IndexError: list index out of range [0]"
)


def planned(config_file, base_config, tmp_path):
    base_config["run"]["output_dir"] = str(tmp_path / "runs")
    plan = build_plan(config_file(base_config))
    path = tmp_path / "plan.lock"
    write_plan(plan, path)
    return plan, path


def test_a_failed_run_prints_its_traceback_as_written_and_no_empty_table(
    config_file, base_config, tmp_path, monkeypatch
):
    plan, path = planned(config_file, base_config, tmp_path)
    with open_store(plan.derived.store) as store:
        store.create_run(plan.run_id, name="t", plan_sha256="x", plan_path="p", run_dir="d")
        store.set_status(plan.run_id, "failed", error=TRACEBACK)
        record = store.get_run(plan.run_id)
    monkeypatch.setattr(launch, "run_plan", lambda *_a, **_k: record)
    result = runner.invoke(app, ["run", "--plan", str(path)])
    assert result.exit_code == 1
    assert "len([bold]completions)" in result.output and "range [0]" in result.output
    assert "┏" not in result.output  # no table: the run wrote no metrics


def test_off_a_terminal_each_step_is_one_plain_line(config_file, base_config, tmp_path):
    plan, _ = planned(config_file, base_config, tmp_path)
    out = io.StringIO()
    view = RunView(Console(file=out, width=80, force_terminal=False))
    with open_store(plan.derived.store) as store:
        store.create_run(plan.run_id, name="t", plan_sha256="x", plan_path="p", run_dir="d")
        view.on_start(plan, False)
        for step in (1, 2):
            store.add_metrics(
                [
                    MetricRecord(plan.run_id, step, "reward/mean", 0.25 * step, time.time()),
                    MetricRecord(plan.run_id, step, "perf/tokens_per_s", 1234.5, time.time()),
                    MetricRecord(plan.run_id, step, "perf/step_s", 0.5, time.time()),
                ]
            )
            view.on_poll(plan, store)
            view.on_poll(plan, store)  # nothing new: nothing printed
        view.stop()
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert lines == [
        "step 1/2  reward 0.25  tok/s 1.23e+03  s/step 0.5",
        "step 2/2  reward 0.5  tok/s 1.23e+03  s/step 0.5",
    ]
    assert "━" not in out.getvalue()  # never a bar
