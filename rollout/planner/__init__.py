"""The compiler: config -> frozen Plan -> plan.lock."""

from rollout.planner.definition import FORMAT_VERSION, Plan

__all__ = ["FORMAT_VERSION", "Plan"]
