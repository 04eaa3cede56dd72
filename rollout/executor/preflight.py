"""Checks the executor makes before it launches anything."""

from __future__ import annotations

from pathlib import Path

from rollout.planner.definition import Plan


def verify_plan(path: str | Path) -> Plan:
    """Read plan.lock and refuse it if edited, stale, or of an unknown format (LockfileError)."""
    return Plan.from_file(str(path), check_fresh=True)
