"""The tools environment's tools, resolved at plan time, and the sandbox choice for those that run
model-written code.

Each tool is imported once here and built with its options (a bad option, or a function tool
without a valid declaration, fails now, naming environment.tools[i]). When a tool runs
model-written code (python, shell), probe_sandbox() tries the sandbox on this host: a missing
capability refuses the plan, naming it and its fallback, unless environment.allow_unsandboxed
says to run with the fallback (then the plan warns, and plan.lock records the choice). A reward
that runs model-written code gets the same decision (planner/reward_sandbox.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rollout.config.algorithm import ONLINE_KINDS
from rollout.config.environment import EnvironmentSection
from rollout.config.root import RunConfig
from rollout.errors import Issue, RolloutError
from rollout.harness.environments.tools import STEP_MARGIN_S
from rollout.harness.sandbox import SandboxReport, probe_sandbox
from rollout.harness.tools import BUILTIN_TOOLS, Tool, Toolbox, plugin_tool
from rollout.planner.definition import ToolRecord, ToolSandbox
from rollout.plugins.probe import probe_imports
from rollout.plugins.registry import TOOL_GROUP
from rollout.plugins.resolve import import_probe, resolve_plugin

GROUP = TOOL_GROUP
"""The entry-point group a tool name is looked up in when it is not a built-in."""


@dataclass(frozen=True)
class ResolvedTools:
    records: list[ToolRecord]
    sandbox: ToolSandbox | None
    instructions: str | None
    """What every episode's first message starts with (None without tools)."""


def resolve_tools(config: RunConfig, base: Path, issues: list[Issue]) -> ResolvedTools:
    spec = config.environment
    if spec is None or not spec.is_tools or config.algorithm.kind not in ONLINE_KINDS:
        return ResolvedTools([], None, None)
    probes = [
        import_probe(
            tool.name,
            base_dir=base,
            used_by=f"environment.tools[{i}].name",
            group=GROUP,
            builtins=BUILTIN_TOOLS,
        )
        for i, tool in enumerate(spec.tools)
    ]
    failed = probe_imports([p for p in probes if p is not None])
    issues.extend(failed.values())
    records: list[ToolRecord] = []
    built: list[Tool] = []
    for i in range(len(spec.tools)):
        if f"environment.tools[{i}].name" not in failed:
            found = _resolve_one(spec, i, base, issues)
            if found is not None:
                records.append(found[0])
                built.append(found[1])
    names = [record.name for record in records]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        issues.append(
            Issue(
                "environment.tools",
                f"two tools are named {', '.join(twice)}: the model could not tell them apart",
                hint="give each function tool its own name in its declaration",
            )
        )
        return ResolvedTools(records, _sandbox(spec, records, issues), None)
    toolbox = Toolbox(built)
    issues.extend(_time_issues(spec, toolbox))
    instructions = toolbox.instructions(spec.tool_format) if built else None
    return ResolvedTools(records, _sandbox(spec, records, issues), instructions)


def _time_issues(spec: EnvironmentSection, toolbox: Toolbox) -> list[Issue]:
    """A call is started only when its limit ends inside the step's time: a tool whose limit
    does not fit could never be called."""
    needed = toolbox.max_s + STEP_MARGIN_S
    if toolbox.max_s == 0 or spec.timeout_s > needed:
        return []
    slowest = max(toolbox.tools.values(), key=lambda tool: tool.max_s)
    return [
        Issue(
            "environment.timeout_s",
            f"the tool {slowest.name!r} may take {slowest.max_s:g} s a call, and a step keeps "
            f"{STEP_MARGIN_S:g} s in hand: a step of {spec.timeout_s:g} s could never call it",
            value=spec.timeout_s,
            hint=f"raise environment.timeout_s above {needed:g}, or lower the tool's time "
            "limit (wall_s, timeout_s)",
        )
    ]


def _resolve_one(
    spec: EnvironmentSection, i: int, base: Path, issues: list[Issue]
) -> tuple[ToolRecord, Tool] | None:
    tool = spec.tools[i]
    where = f"environment.tools[{i}]"
    try:
        resolved = resolve_plugin(
            tool.name, base_dir=base, used_by=f"{where}.name", group=GROUP, builtins=BUILTIN_TOOLS
        )
    except RolloutError as error:
        issues.extend(error.issues)
        return None
    builtin = resolved.identity.kind == "builtin"
    if builtin and tool.function is not None:
        issues.append(
            Issue(
                f"{where}.function",
                f"the built-in tool {tool.name!r} declares itself",
                hint=f"remove {where}.function",
            )
        )
        return None
    if not builtin and tool.options:
        issues.append(
            Issue(
                f"{where}.options",
                "a function tool takes no options: the model's call gives its arguments",
                value=tool.options,
                hint=f"remove {where}.options",
            )
        )
        return None
    try:
        built: Tool = (
            resolved.fn(**tool.options)
            if builtin
            else plugin_tool(resolved.fn, tool.function, f"{where}.function")
        )
    except (TypeError, ValueError) as error:
        field = "options" if builtin else "function"
        issues.append(
            Issue(
                f"{where}.{field}",
                f"{tool.name}: {error}",
                value=tool.options if builtin else tool.function,
                hint="see docs/tools.md for the built-in tools' options and the declaration "
                "a function tool needs",
            )
        )
        return None
    declaration = None if builtin else built.schema()["function"]
    record = ToolRecord(
        name=built.name,
        plugin=resolved.identity,
        options=tool.options,
        function=declaration,
        runs_code=built.runs_code,
    )
    return record, built


def _sandbox(
    spec: EnvironmentSection, records: list[ToolRecord], issues: list[Issue]
) -> ToolSandbox | None:
    running = [record.name for record in records if record.runs_code]
    if not running:
        if spec.allow_unsandboxed:
            issues.append(
                Issue(
                    "environment.allow_unsandboxed",
                    "no tool of this run executes model-written code: there is nothing to run "
                    "unsandboxed",
                    value=True,
                    hint="remove allow_unsandboxed",
                )
            )
        return None
    decision, issue = sandbox_decision(
        probe_sandbox(),
        f"the tool(s) {', '.join(running)}",
        spec.allow_unsandboxed,
        where="environment.tools",
        opt_out="environment.allow_unsandboxed",
        instead="remove the tool",
    )
    issues.extend([issue] if issue is not None else [])
    return decision


def sandbox_decision(
    report: SandboxReport,
    runner: str,
    allow_unsandboxed: bool,
    *,
    where: str,
    opt_out: str,
    instead: str,
) -> tuple[ToolSandbox, Issue | None]:
    """What the run does with this host's sandbox: the record for plan.lock, and the refusal
    when a capability is missing and the config did not opt out.

    runner: what runs the code ("the tool(s) python", "the reward 'code_tests'"); where: the
    config path the refusal names; opt_out: the setting that accepts the fallbacks; instead:
    the other way out ("remove the tool").
    """
    missing = [c.line() for c in report.capabilities if not c.works]
    decision = ToolSandbox(
        allow_unsandboxed=allow_unsandboxed,
        require_network_isolation=report.works("network isolation") or not allow_unsandboxed,
        missing=missing,
    )
    if not missing or allow_unsandboxed:
        return decision, None
    return decision, Issue(
        where,
        f"{runner} run model-written code, but this host's sandbox cannot enforce "
        "everything: " + "; ".join(missing),
        hint=f"run where the sandbox works (docs/sandbox.md), {instead}, or set "
        f"{opt_out} = true to run with the fallbacks named",
    )


def sandbox_warnings(tool_sandbox: ToolSandbox | None, runner: str = "tools") -> list[str]:
    """What `rollout plan` warns about code (tools, or a reward) that opted out of a full
    sandbox."""
    if tool_sandbox is None or not tool_sandbox.missing:
        return []
    return [f"running {runner} without a full sandbox: {line}" for line in tool_sandbox.missing]
