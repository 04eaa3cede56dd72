"""Environments: what multi-turn episodes talk to (base.py), the built-ins, and the runner that
calls them under time limits (runner.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout.harness.environments.base import Environment, StepResult
from rollout.harness.environments.guess_number import GuessNumber
from rollout.harness.environments.gymnasium_text import GymnasiumText

SINGLE_TURN = "single_turn"
"""The built-in the runtime builds itself (it scores with the run's [[rewards]])."""

BUILTIN_ENVIRONMENTS: dict[str, Callable[..., Any]] = {
    "guess_number": GuessNumber,
    "gymnasium": GymnasiumText,
}
"""Built-ins a config names by name, each called with the environment's options."""


def plan_builtins() -> dict[str, Callable[..., Any]]:
    """Every name [environment].name resolves to without a plugin: BUILTIN_ENVIRONMENTS, and the
    environments the run builds itself from the rest of the config (single_turn from [[rewards]],
    tools from environment.tools, agent from its command)."""
    from rollout.harness.agents import AGENT, AgentSpec
    from rollout.harness.environments.single_turn import SingleTurn
    from rollout.harness.environments.tools import TOOLS, ToolEnvironment

    return {
        **BUILTIN_ENVIRONMENTS,
        SINGLE_TURN: SingleTurn,
        TOOLS: ToolEnvironment,
        AGENT: AgentSpec,
    }


__all__ = ["BUILTIN_ENVIRONMENTS", "SINGLE_TURN", "Environment", "StepResult", "plan_builtins"]
