"""The tools environment for real: `rollout plan` and `rollout run` of examples/tools-tiny.toml
(the calculator tool, answers scored by [[rewards]]) on the tiny model, with tool-call metrics
recorded; and the plan refusing a code-running tool that is given options it does not take."""

from __future__ import annotations

import json

import pytest

from tests.integration.driver import only_run, rollout

pytestmark = pytest.mark.slow

TOOL_METRICS = (
    "episode/tool_calls_mean",
    "episode/invalid_tool_calls_mean",
    "episode/valid_tool_call_fraction",
)


def test_a_tools_run_records_tool_call_metrics(workdir):
    result = rollout(
        workdir,
        "run",
        "--config",
        "examples/tools-tiny.toml",
        "--set",
        "algorithm.max_steps=2",
        "--set",
        "environment.tools=[{name='calculator'}, {name='python', options={wall_s=5}}]",
        "--set",
        "generation.max_prompt_tokens=900",  # two tools' declarations, a token per char or two
        "--set",
        "environment.max_turns=2",  # the episode within the tiny model's 1024 tokens
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    store, record = only_run(workdir)
    assert record.status == "finished"
    for name in (*TOOL_METRICS, "reward/mean", "episode/turns_mean"):
        values = [m.value for m in store.metrics(record.run_id, [name])]
        assert len(values) == 2, (name, values)  # one per step
    calls = [m.value for m in store.metrics(record.run_id, ["episode/tool_calls_mean"])]
    turns = [m.value for m in store.metrics(record.run_id, ["episode/turns_mean"])]
    assert all(c >= 0 for c in calls) and all(1 <= t <= 3 for t in turns)
    lock = json.loads((workdir / "runs" / record.run_id / "plan.lock").read_text())["plan"]
    assert [tool["name"] for tool in lock["tools"]] == ["calculator", "python"]
    assert lock["tool_sandbox"]["allow_unsandboxed"] is False


def test_plan_refuses_a_tool_option_naming_it(workdir):
    result = rollout(
        workdir,
        "plan",
        "--config",
        "examples/tools-tiny.toml",
        "--set",
        "environment.tools=[{name='python', options={wall=5}}]",
    )
    assert result.returncode == 2
    assert "environment.tools[0].options" in result.stderr and "wall" in result.stderr
    assert "Traceback" not in result.stderr
