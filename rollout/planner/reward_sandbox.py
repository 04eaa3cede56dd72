"""The sandbox choice for a reward that runs model-written code (code_tests, or a function with
``runs_model_code = True``): the same probe and decision as the tools' (planner/tools.py).

A missing capability refuses the plan, naming it and its fallback, unless
``rewards[i].allow_unsandboxed`` says to run with the fallback; the decision goes into the
reward's record in plan.lock, and the worker passes it to the reward as
``require_network_isolation``, which the reward's options may therefore not set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout.config.rewards import RewardSpec
from rollout.errors import Issue
from rollout.harness.reward_contract import SANDBOX_KEYWORD, accepted_keywords, runs_model_code
from rollout.harness.sandbox import probe_sandbox
from rollout.planner.definition import ToolSandbox
from rollout.planner.tools import sandbox_decision


def reward_sandbox(
    spec: RewardSpec, i: int, fn: Callable[..., Any], issues: list[Issue]
) -> ToolSandbox | None:
    """The record's sandbox field: None for a reward that runs no model-written code."""
    where = f"rewards[{i}]"
    if not runs_model_code(fn):
        if spec.allow_unsandboxed:
            issues.append(
                Issue(
                    f"{where}.allow_unsandboxed",
                    f"the reward {spec.fn!r} runs no model-written code: there is nothing to "
                    "run unsandboxed",
                    value=True,
                    hint=f"remove {where}.allow_unsandboxed",
                )
            )
        return None
    if SANDBOX_KEYWORD in spec.options:
        issues.append(
            Issue(
                f"{where}.options.{SANDBOX_KEYWORD}",
                f"the plan passes {SANDBOX_KEYWORD} to a reward that runs model-written code, "
                "from its sandbox probe: it is not an option",
                value=spec.options[SANDBOX_KEYWORD],
                hint=f"remove the option; to run on a host without network isolation set "
                f"{where}.allow_unsandboxed = true",
            )
        )
    accepts = accepted_keywords(fn)
    if accepts is not None and SANDBOX_KEYWORD not in accepts:
        issues.append(
            Issue(
                f"{where}.fn",
                f"{spec.fn!r} declares runs_model_code but takes no {SANDBOX_KEYWORD!r} "
                "parameter, so it could not be told whether the network must be isolated",
                value=spec.fn,
                hint=f"add a keyword parameter {SANDBOX_KEYWORD}: bool = True and pass it to "
                "the sandbox (see docs/sandbox.md)",
            )
        )
    decision, issue = sandbox_decision(
        probe_sandbox(),
        f"the reward {spec.metric_name!r}",
        spec.allow_unsandboxed,
        where=f"{where}.fn",
        opt_out=f"{where}.allow_unsandboxed",
        instead="use another reward",
    )
    issues.extend([issue] if issue is not None else [])
    return decision
