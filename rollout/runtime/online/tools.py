"""The tools environment a plan describes: its tools built from plan.tools (each imported as the
planner resolved it, never resolved again), confined as plan.tool_sandbox says."""

from __future__ import annotations

import logging

from rollout.harness.environments.single_turn import Score
from rollout.harness.environments.tools import ToolEnvironment
from rollout.harness.tools import Tool, Toolbox, plugin_tool
from rollout.planner.definition import Plan, ToolRecord
from rollout.plugins.resolve import load_plugin

log = logging.getLogger("rollout.tools")


def build_tool_environment(plan: Plan, score: Score, prompt_field: str) -> ToolEnvironment:
    spec = plan.config.environment
    assert spec is not None and spec.is_tools
    sandbox = plan.tool_sandbox
    for line in sandbox.missing if sandbox is not None else []:
        log.warning("tools run without a full sandbox (environment.allow_unsandboxed): %s", line)
    return ToolEnvironment(
        score,
        prompt_field,
        Toolbox([_build(record, i) for i, record in enumerate(plan.tools)]),
        format=spec.tool_format,
        require_network_isolation=sandbox.require_network_isolation if sandbox else True,
        step_timeout_s=spec.timeout_s,
    )


def _build(record: ToolRecord, i: int) -> Tool:
    fn = load_plugin(record.plugin)
    if record.plugin.kind == "builtin":
        return fn(**record.options)
    return plugin_tool(fn, record.function, f"environment.tools[{i}].function")
