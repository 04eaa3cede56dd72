"""rewards[i].isolation = "sidecar" through validate, plan and the worker's reward functions:
python without a sidecar is refused, the plan health-checks the sidecar (one that cannot start
fails `rollout plan` naming the reward) and records it in plan.lock, and the worker calls the
sidecar in place of the function."""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import pytest

from rollout import ConfigError
from rollout.config import validate_config
from rollout.errors import PlanError
from rollout.planner.builder import build_plan
from rollout.planner.lockfile import read_plan, write_plan
from rollout.plugins.sidecar.host import SidecarCallable
from rollout.runtime.components import build_reward_functions

PLUGINS = """
def answer_length(prompts, completions, answer):
    return [float(len(c) + len(a)) for c, a in zip(completions, answer)]
"""


@pytest.fixture
def sidecar_config(base_config, tmp_path) -> dict[str, Any]:
    (tmp_path / "my_rewards.py").write_text(PLUGINS)
    raw = copy.deepcopy(base_config)
    raw["rewards"] = [{"fn": "./my_rewards.py:answer_length", "isolation": "sidecar"}]
    return raw


def issues_of(error: ConfigError | PlanError) -> dict[str, str]:
    return {issue.path: str(issue) for issue in error.issues}


def test_python_without_a_sidecar_is_refused_at_validate(base_config):
    raw = copy.deepcopy(base_config)
    raw["rewards"][0]["python"] = sys.executable
    with pytest.raises(ConfigError) as caught:
        validate_config(raw)
    assert 'isolation = "sidecar"' in issues_of(caught.value)["rewards[0].python"]


def test_a_reward_model_cannot_run_in_a_sidecar(base_config):
    raw = copy.deepcopy(base_config)
    raw["rewards"] = [{"model": "runs/x", "isolation": "sidecar"}]
    with pytest.raises(ConfigError) as caught:
        validate_config(raw)
    assert "rewards[0].isolation" in issues_of(caught.value)


def test_fail_sample_without_a_sidecar_and_a_failure_score_without_it_are_refused(base_config):
    raw = copy.deepcopy(base_config)
    raw["rewards"][0].update(on_error="fail_sample")
    raw["rewards"].append({"fn": "numeric_match", "failure_score": -1.0})
    with pytest.raises(ConfigError) as caught:
        validate_config(raw)
    issues = issues_of(caught.value)
    assert 'set rewards[0].isolation = "sidecar"' in issues["rewards[0].on_error"]
    assert 'set rewards[1].on_error = "fail_sample"' in issues["rewards[1].failure_score"]


def test_the_failure_policy_travels_from_the_config_to_the_workers_function(
    config_file, sidecar_config, tmp_path
):
    sidecar_config["rewards"][0].update(on_error="fail_sample", failure_score=-0.5)
    write_plan(build_plan(config_file(sidecar_config)), tmp_path / "plan.lock")
    plan = read_plan(tmp_path / "plan.lock")
    assert (plan.rewards[0].on_error, plan.rewards[0].failure_score) == ("fail_sample", -0.5)
    [function] = build_reward_functions(plan)
    try:
        assert (function.on_error, function.failure_score) == ("fail_sample", -0.5)
    finally:
        function.fn.close()


def test_the_plan_records_the_sidecar_and_the_worker_calls_it(
    config_file, sidecar_config, tmp_path
):
    plan = build_plan(config_file(sidecar_config))
    [record] = plan.rewards
    assert record.isolation == "sidecar" and record.python is None
    write_plan(plan, tmp_path / "plan.lock")
    again = read_plan(tmp_path / "plan.lock")
    assert again.rewards[0].isolation == "sidecar"
    [function] = build_reward_functions(again)
    try:
        assert isinstance(function.fn, SidecarCallable)
        assert function.fn.host.pid != os.getpid()
        assert function.accepts == frozenset({"answer"})  # the signature came from the child
        assert function.fn(["p"], ["abc"], answer=["12"]) == [5.0]
    finally:
        function.fn.close()


def test_in_process_is_the_default_and_builds_the_function_itself(config_file, sidecar_config):
    del sidecar_config["rewards"][0]["isolation"]
    plan = build_plan(config_file(sidecar_config))
    assert plan.rewards[0].isolation == "in_process"
    [function] = build_reward_functions(plan)
    assert not isinstance(function.fn, SidecarCallable)


def test_the_python_a_sidecar_runs_is_resolved_and_recorded(config_file, sidecar_config):
    sidecar_config["rewards"][0]["python"] = sys.executable
    plan = build_plan(config_file(sidecar_config))
    assert plan.rewards[0].python == sys.executable


def test_an_interpreter_that_is_not_there_fails_the_plan(config_file, sidecar_config):
    sidecar_config["rewards"][0]["python"] = "./venv/bin/python"
    with pytest.raises(PlanError) as caught:
        build_plan(config_file(sidecar_config))
    assert "no such interpreter" in issues_of(caught.value)["rewards[0].python"]


def test_a_sidecar_that_cannot_start_fails_the_plan_naming_the_reward(
    config_file, sidecar_config, tmp_path
):
    """An interpreter without rollout: the child dies before its hello, and says why."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'No module named rollout' >&2\nexit 1\n")
    fake.chmod(0o755)
    sidecar_config["rewards"][0]["python"] = str(fake)
    with pytest.raises(PlanError) as caught:
        build_plan(config_file(sidecar_config))
    message = issues_of(caught.value)["rewards[0].isolation"]
    assert "health check" in message and "'answer_length'" in message
    assert "No module named rollout" in message


def test_rollout_plan_explain_says_where_each_plugin_runs(config_file, sidecar_config, tmp_path):
    from typer.testing import CliRunner

    from rollout.cli.app import app

    sidecar_config["rewards"].append({"fn": "numeric_match"})
    lock = tmp_path / "plan.lock"
    result = CliRunner().invoke(
        app,
        ["plan", "--config", str(config_file(sidecar_config)), "-o", str(lock), "--explain"],
        env={"COLUMNS": "250"},
    )
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines() if "│" in line}
    assert "sidecar (this python)" in rows["rewards[0].fn"]
    assert "worker" in rows["rewards[1].fn"]
