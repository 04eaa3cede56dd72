"""A reward that runs model-written code, planned: the sandbox probe's refusal, the
rewards[i].allow_unsandboxed opt-out recorded in plan.lock, and what the worker passes on."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from rollout import ConfigError
from rollout.config import validate_config
from rollout.errors import PlanError
from rollout.harness.sandbox import Capability, SandboxReport
from rollout.planner import reward_sandbox
from rollout.planner.builder import build_plan
from rollout.planner.lockfile import read_plan, write_plan
from rollout.runtime.components import build_reward_functions

NO_NETWORK_ISOLATION = SandboxReport(
    (
        Capability("network isolation", False, "network is NOT isolated (no namespaces)"),
        Capability("memory", True, "RLIMIT_AS per process"),
    )
)

ROWS = [{"prompt": f"Write add; case {i}.", "tests": "assert add(1, 2) == 3"} for i in range(8)]

PLUGINS = """
def checked(prompts, completions, *, require_network_isolation=True):
    return [float(require_network_isolation)] * len(completions)

checked.runs_model_code = True


def careless(prompts, completions):
    return [0.0] * len(completions)

careless.runs_model_code = True
"""


@pytest.fixture
def code_config(base_config, tmp_path) -> dict[str, Any]:
    """The base config scoring code with code_tests on rows that carry tests."""
    (tmp_path / "code.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (tmp_path / "code_rewards.py").write_text(PLUGINS)
    raw = copy.deepcopy(base_config)
    raw["data"] = {"train": {"path": "code.jsonl"}, "fields": {"prompt": "prompt"}}
    raw["rewards"] = [{"fn": "code_tests", "options": {"timeout_s": 2.0}}]
    return raw


@pytest.fixture
def host_without_network_isolation(monkeypatch):
    """A host whose sandbox cannot isolate the network (this one can: the probe's report is
    replaced, the one thing here that cannot be produced for real)."""
    monkeypatch.setattr(reward_sandbox, "probe_sandbox", lambda: NO_NETWORK_ISOLATION)


def plan_issues(config_file, raw) -> dict[str, Any]:
    with pytest.raises(PlanError) as caught:
        build_plan(config_file(raw))
    return {issue.path: issue for issue in caught.value.issues}


def test_on_a_working_sandbox_the_reward_plans_requiring_isolation(config_file, code_config):
    if not reward_sandbox.probe_sandbox().works("network isolation"):
        pytest.skip("this host's sandbox cannot isolate the network")
    plan = build_plan(config_file(code_config))
    sandbox = plan.rewards[0].sandbox
    assert sandbox.require_network_isolation and not sandbox.allow_unsandboxed
    assert sandbox.missing == []
    [function] = build_reward_functions(plan)
    assert function.options == {"timeout_s": 2.0, "require_network_isolation": True}


def test_a_missing_capability_refuses_the_plan_naming_the_gap(
    config_file, code_config, host_without_network_isolation
):
    message = str(plan_issues(config_file, code_config)["rewards[0].fn"])
    assert "the reward 'code_tests' run model-written code" in message
    assert "network is NOT isolated" in message
    assert "rewards[0].allow_unsandboxed = true" in message


def test_the_opt_out_plans_and_is_recorded_in_plan_lock_and_passed_to_the_reward(
    config_file, code_config, host_without_network_isolation, tmp_path
):
    code_config["rewards"][0]["allow_unsandboxed"] = True
    plan = build_plan(config_file(code_config))
    lock = tmp_path / "plan.lock"
    write_plan(plan, lock)
    recorded = json.loads(lock.read_text())["plan"]["rewards"][0]["sandbox"]
    assert recorded["allow_unsandboxed"] is True
    assert recorded["require_network_isolation"] is False
    assert "network is NOT isolated" in recorded["missing"][0]
    assert read_plan(lock).rewards[0].sandbox == plan.rewards[0].sandbox
    [function] = build_reward_functions(read_plan(lock))
    assert function.options["require_network_isolation"] is False


def test_a_plugin_that_declares_running_code_gets_the_decision(
    config_file, code_config, host_without_network_isolation
):
    code_config["rewards"] = [{"fn": "./code_rewards.py:checked", "allow_unsandboxed": True}]
    plan = build_plan(config_file(code_config))
    [function] = build_reward_functions(plan)
    assert function.fn(["p"], ["c"], **function.options) == [0.0]  # told: not isolated


def test_a_plugin_that_runs_code_must_take_the_decision(config_file, code_config):
    code_config["rewards"] = [{"fn": "./code_rewards.py:careless"}]
    message = str(plan_issues(config_file, code_config)["rewards[0].fn"])
    assert "takes no 'require_network_isolation' parameter" in message


def test_the_decision_is_not_an_option(config_file, code_config):
    code_config["rewards"][0]["options"]["require_network_isolation"] = False
    found = plan_issues(config_file, code_config)
    assert "not an option" in found["rewards[0].options.require_network_isolation"].message


def test_allow_unsandboxed_on_a_reward_that_runs_no_code_is_refused(config_file, base_config):
    base_config["rewards"][0]["allow_unsandboxed"] = True
    found = plan_issues(config_file, base_config)
    assert "runs no model-written code" in found["rewards[0].allow_unsandboxed"].message


def test_allow_unsandboxed_on_a_reward_model_is_refused_at_validate(base_config):
    base_config["rewards"] = [{"model": "runs/rm", "allow_unsandboxed": True}]
    with pytest.raises(ConfigError) as caught:
        validate_config(base_config)
    assert "rewards[0].allow_unsandboxed" in {issue.path for issue in caught.value.issues}


def test_rollout_plan_warns_about_the_opt_out_and_explains_it(
    config_file, code_config, host_without_network_isolation, tmp_path
):
    from typer.testing import CliRunner

    from rollout.cli.app import app

    code_config["rewards"][0]["allow_unsandboxed"] = True
    lock = tmp_path / "plan.lock"
    result = CliRunner().invoke(
        app, ["plan", "--config", str(config_file(code_config)), "-o", str(lock), "--explain"]
    )
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())  # rich wraps long lines
    assert "warning: running the reward 'code_tests' without a full sandbox: network" in output
    assert "for reward 'code_tests' (rewards[0].allow_unsandboxed)" in output
