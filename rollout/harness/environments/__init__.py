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

__all__ = ["BUILTIN_ENVIRONMENTS", "SINGLE_TURN", "Environment", "StepResult"]
