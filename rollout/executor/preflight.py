"""Checks the executor makes before it launches anything."""

from __future__ import annotations

from pathlib import Path

from rollout.errors import LockfileError
from rollout.planner.definition import Plan
from rollout.planner.lockfile import read_plan
from rollout.planner.runnable import run_refusals


def verify_plan(path: str | Path) -> Plan:
    """Read plan.lock and refuse it (LockfileError) if edited, stale, of an unknown format, or
    asking for what this rollout cannot run: the same refusals `rollout plan` makes, asked again
    of a lock that another rollout wrote or someone edited."""
    plan = read_plan(path, check_fresh=True)
    refusals = run_refusals(plan.config, plan.graph)
    if refusals:
        raise LockfileError(refusals, source=str(path))
    return plan
