"""The environment Protocol: what a multi-turn episode talks to.

An environment runs a batch of episodes at once (batch-first, like rewards). `reset` starts one
episode per dataset row and returns each one's first observation: the first user message the
model answers. `step` takes the model's answers for some of those episodes (the ones not done
yet, by their index in the reset batch) and returns, for each, what the environment says next:
an observation (the next user message), a reward for that turn, whether the episode is over,
and an info dict that goes into the run's logs.

A plugin is a class (or any callable) the run calls once with the environment's `options` as
keyword arguments; it returns the environment. Its `close()`, when it has one, is called when the
run ends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Row = Mapping[str, Any]


@dataclass(frozen=True)
class StepResult:
    observation: str = ""
    """The next user message; ignored once the episode is done."""
    reward: float = 0.0
    """This turn's reward; an episode's return is the sum of its turns' rewards."""
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)
    """Anything worth logging (JSON-able): e.g. {"solved": true}."""
    role: Literal["user", "tool"] = "user"
    """Whose turn the observation is in the chat template: "tool" for tool results (written as
    a user turn when the model's chat template has no tool role)."""


@runtime_checkable
class Environment(Protocol):
    def reset(self, rows: Sequence[Row], *, seed: int) -> list[str]:
        """Start one episode per row (a dataset record, with the config's field roles under their
        own names, as rewards get it). Returns each episode's first observation. `seed` makes any
        randomness of the environment repeatable."""
        ...

    def step(self, episodes: Sequence[int], actions: Sequence[str]) -> list[StepResult]:
        """Advance `episodes` (indices into the last reset's rows) with the model's `actions`
        (its answers, as text); one StepResult per episode, in the same order."""
        ...
