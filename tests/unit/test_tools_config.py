"""[environment] name = "tools" in the config and the plan: what validate refuses, the tools the
plan resolves and builds, the sandbox probe's refusal and the opt-out recorded in plan.lock."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from rollout import ConfigError
from rollout.config import validate_config
from rollout.errors import PlanError
from rollout.harness.sandbox import Capability, SandboxReport
from rollout.planner import tools as planner_tools
from rollout.planner.builder import build_plan
from rollout.planner.lockfile import read_plan, write_plan


def with_tools(base: dict[str, Any], *tools: dict[str, Any], **environment: Any) -> dict[str, Any]:
    raw = copy.deepcopy(base)
    raw["environment"] = {
        "name": "tools",
        "max_turns": 3,
        "tools": list(tools) or [{"name": "calculator"}],
        **environment,
    }
    raw["generation"]["max_prompt_tokens"] = 700  # declarations: a token per char or two here
    return raw


def issues_of(raw: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(ConfigError) as caught:
        validate_config(raw)
    return {issue.path: issue for issue in caught.value.issues}


def plan_issues(config_file, raw) -> dict[str, Any]:
    with pytest.raises(PlanError) as caught:
        build_plan(config_file(raw))
    return {issue.path: issue for issue in caught.value.issues}


def test_the_tools_environment_validates_with_rewards(base_config):
    config = validate_config(with_tools(base_config))
    assert config.environment.is_tools and config.environment.tools[0].name == "calculator"


@pytest.mark.parametrize(
    ("change", "path", "says"),
    [
        ({"rewards": []}, "rewards", "scores the final answer with [[rewards]]"),
        ({"environment": {"tools": []}}, "environment.tools", "at least one tool"),
        ({"environment": {"options": {"x": 1}}}, "environment.options", "takes no options"),
        ({"environment": {"max_turns": 1}}, "environment.max_turns", "could never reach"),
    ],
)
def test_validate_refuses_a_tools_environment_that_cannot_run(base_config, change, path, says):
    raw = with_tools(base_config)
    for section, values in change.items():
        if isinstance(values, dict):
            raw[section].update(values)
        else:
            raw[section] = values
    found = issues_of(raw)
    assert path in found and says in found[path].message, found


@pytest.mark.parametrize(
    ("setting", "path"),
    [
        ({"tools": [{"name": "calculator"}]}, "environment.tools"),
        ({"tool_format": "json"}, "environment.tool_format"),
        ({"allow_unsandboxed": True}, "environment.allow_unsandboxed"),
    ],
)
def test_tool_settings_are_refused_for_other_environments(base_config, setting, path):
    raw = copy.deepcopy(base_config)
    raw["environment"] = {"name": "single_turn", **setting}
    assert path in issues_of(raw)
    raw.pop("rewards")
    raw["data"]["fields"].pop("answer")
    raw["environment"] = {"name": "guess_number", "max_turns": 2, **setting}
    assert path in issues_of(raw)


def test_plan_resolves_and_records_the_tools(config_file, base_config, tmp_path):
    (tmp_path / "mytools.py").write_text(
        "def lookup(city):\n    return city.upper()\n\n"
        "lookup.schema = {'name': 'lookup', 'description': 'Look a city up.', 'parameters': "
        "{'type': 'object', 'properties': {'city': {'type': 'string'}}}}\n"
    )
    raw = with_tools(base_config, {"name": "calculator"}, {"name": "./mytools.py:lookup"})
    plan = build_plan(config_file(raw))
    assert [tool.name for tool in plan.tools] == ["calculator", "lookup"]
    calculator, lookup = plan.tools
    assert calculator.plugin.kind == "builtin" and calculator.function is None
    assert lookup.plugin.kind == "file" and lookup.function["description"] == "Look a city up."
    assert lookup.plugin in plan.plugins  # editing the file makes the plan stale
    assert plan.tool_sandbox is None  # nothing runs model-written code


@pytest.mark.parametrize(
    ("tool", "path", "says"),
    [
        ({"name": "calculater"}, "environment.tools[0].name", "calculator"),
        ({"name": "shell", "options": {"allowed": []}}, "environment.tools[0].options", "at least"),
        (
            {"name": "calculator", "options": {"digits": 3}},
            "environment.tools[0].options",
            "digits",
        ),
        (
            {"name": "calculator", "function": {"name": "calc"}},
            "environment.tools[0].function",
            "declares itself",
        ),
        ({"name": "./mytools.py:bare"}, "environment.tools[0].function", "has no schema"),
        (
            {"name": "./mytools.py:bare", "options": {"a": 1}},
            "environment.tools[0].options",
            "takes no options",
        ),
    ],
)
def test_plan_refuses_tools_it_cannot_build(config_file, base_config, tmp_path, tool, path, says):
    (tmp_path / "mytools.py").write_text("def bare(**kw):\n    return ''\n")
    found = plan_issues(config_file, with_tools(base_config, tool))
    assert path in found and says in str(found[path]), found


def test_plan_refuses_two_tools_with_one_name(config_file, base_config):
    raw = with_tools(base_config, {"name": "calculator"}, {"name": "calculator"})
    assert (
        "two tools are named calculator"
        in plan_issues(config_file, raw)["environment.tools"].message
    )


def test_plan_counts_the_tools_declarations_against_max_prompt_tokens(config_file, base_config):
    raw = with_tools(base_config)
    raw["generation"]["max_prompt_tokens"] = 100  # the prompts alone fit in 32
    message = plan_issues(config_file, raw)["generation.max_prompt_tokens"].message
    assert "the tools' declarations before it" in message


def test_plan_refuses_a_step_too_short_for_a_tools_time_limit(config_file, base_config):
    raw = with_tools(base_config, {"name": "python", "options": {"wall_s": 20}}, timeout_s=15)
    message = plan_issues(config_file, raw)["environment.timeout_s"].message
    assert "'python' may take 20 s a call" in message


def test_allow_unsandboxed_without_a_code_tool_is_refused(config_file, base_config):
    found = plan_issues(config_file, with_tools(base_config, allow_unsandboxed=True))
    assert "nothing to run unsandboxed" in found["environment.allow_unsandboxed"].message


NO_NETWORK_ISOLATION = SandboxReport(
    (
        Capability("network isolation", False, "network is NOT isolated (no namespaces)"),
        Capability("memory", True, "RLIMIT_AS per process"),
    )
)


@pytest.fixture
def host_without_network_isolation(monkeypatch):
    """A host whose sandbox cannot isolate the network (this one can: the probe's report is
    replaced, the one thing here that cannot be produced for real)."""
    monkeypatch.setattr(planner_tools, "probe_sandbox", lambda: NO_NETWORK_ISOLATION)


def test_a_code_tool_on_a_working_sandbox_plans_and_requires_isolation(config_file, base_config):
    if not planner_tools.probe_sandbox().works("network isolation"):
        pytest.skip("this host's sandbox cannot isolate the network")
    plan = build_plan(config_file(with_tools(base_config, {"name": "python"})))
    assert plan.tools[0].runs_code
    assert plan.tool_sandbox.require_network_isolation and not plan.tool_sandbox.allow_unsandboxed


def test_a_code_tool_without_a_working_sandbox_is_refused_naming_the_gap(
    config_file, base_config, host_without_network_isolation
):
    found = plan_issues(config_file, with_tools(base_config, {"name": "python"}))
    message = str(found["environment.tools"])
    assert "python run model-written code" in message
    assert "network is NOT isolated" in message and "allow_unsandboxed = true" in message


def test_the_opt_out_plans_warns_and_is_recorded_in_plan_lock(
    config_file, base_config, host_without_network_isolation, tmp_path
):
    raw = with_tools(base_config, {"name": "shell", "options": {"allowed": ["ls"]}})
    raw["environment"]["allow_unsandboxed"] = True
    plan = build_plan(config_file(raw))
    lock = tmp_path / "plan.lock"
    write_plan(plan, lock)
    recorded = json.loads(lock.read_text())["plan"]["tool_sandbox"]
    assert recorded["allow_unsandboxed"] is True
    assert recorded["require_network_isolation"] is False
    assert "network is NOT isolated" in recorded["missing"][0]
    assert read_plan(lock).tool_sandbox == plan.tool_sandbox
    [warning] = planner_tools.sandbox_warnings(plan.tool_sandbox)
    assert warning.startswith("running tools without a full sandbox: network isolation")


def test_rollout_plan_prints_the_opt_outs_warnings_and_explains_the_sandbox(
    config_file, base_config, host_without_network_isolation, tmp_path
):
    from typer.testing import CliRunner

    from rollout.cli.app import app

    raw = with_tools(base_config, {"name": "python"}, allow_unsandboxed=True)
    lock = tmp_path / "plan.lock"
    result = CliRunner().invoke(
        app, ["plan", "--config", str(config_file(raw)), "-o", str(lock), "--explain"]
    )
    assert result.exit_code == 0, result.output
    assert "warning: running tools without a full sandbox: network isolation" in result.output
    assert "sandbox   without: network isolation" in result.output
