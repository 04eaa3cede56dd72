"""rollout: train LLMs with reinforcement learning from one declarative config.

Library use mirrors the CLI:

    from rollout import load_config, plan, read_plan, write_plan, RolloutError
    config = load_config("run.toml")            # validate: schema + cross-field rules
    the_plan = plan("run.toml")                 # resolve plugins, model, data, hardware
    write_plan(the_plan, "plan.lock")           # freeze it: canonical JSON with its sha256
    the_plan = read_plan("plan.lock")           # read and verify a frozen plan
    record = run("plan.lock")                   # execute it; blocks; returns the run's record

Every user mistake raises RolloutError (a ConfigError, PlanError or LockfileError) whose
``.issues`` carry dotted paths, values and hints.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout.config import RunConfig, load_config
from rollout.errors import ConfigError, Issue, LockfileError, PlanError, RolloutError
from rollout.version import __version__

if TYPE_CHECKING:
    from rollout.planner import Plan
    from rollout.planner.lockfile import read_plan, write_plan


def plan(config: str | Any, **kwargs: Any) -> Plan:
    """Plan a config file (or a RunConfig). See rollout.planner.builder.build_plan."""
    from rollout.planner.builder import build_plan

    return build_plan(config, **kwargs)


def run(plan: str | Any) -> Any:
    """Execute a plan (a plan.lock path or a Plan); block until it ends; return its RunRecord."""
    from rollout.executor.launch import run_plan

    if not isinstance(plan, str | os.PathLike):
        from rollout.planner.lockfile import write_plan

        path = Path(plan.derived.run_dir) / "plan.lock"
        write_plan(plan, path)
        plan = path
    return run_plan(plan)


def __getattr__(name: str) -> Any:
    # Lazy: importing rollout stays cheap for `rollout validate`.
    if name == "Plan":
        from rollout.planner import Plan

        return Plan
    if name in ("read_plan", "write_plan"):
        from rollout.planner import lockfile

        return getattr(lockfile, name)
    raise AttributeError(name)


__all__ = [
    "ConfigError",
    "Issue",
    "LockfileError",
    "Plan",
    "PlanError",
    "RolloutError",
    "RunConfig",
    "__version__",
    "load_config",
    "plan",
    "read_plan",
    "run",
    "write_plan",
]
