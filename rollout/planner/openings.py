"""How an episode opens, for the plan's check that every prompt fits
generation.max_prompt_tokens.

A single-turn run's prompt is the record's prompt field. An episode's is its environment's first
observation: the tools environment puts the tools' declarations before the prompt, and a plugin
environment writes whatever its `reset` returns (guess-the-number's rules, a Gymnasium
observation). The worker refuses an episode whose first observation is longer than
max_prompt_tokens when it starts (rollout.runtime.online.episodes), so the plan resets the
environment on each record, as the worker will, and counts what comes back: whatever `run`
would refuse, `plan` refuses first.

A plugin environment's reset runs here in the planning process (its factory was imported here
already), one record at a time under environment.timeout_s. A reset that raises or hangs is the
record's problem, named with it. Resets stop after OPENING_BUDGET_S in all: the records left
are then counted by their prompt field only, and the plan says so. Not opened here: a sidecar
environment (its process is the run's), one that keeps an episodic memory (it would remember
the plan's resets) and the agent environment (its programs open their own episodes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout.config.root import RunConfig

log = logging.getLogger(__name__)

OPENING_BUDGET_S = 20.0
"""Seconds of environment resets a plan spends at most."""
BUILD_TIMEOUT_S = 60.0
"""Seconds the plan waits for the environment's constructor."""


class OpeningFailed(Exception):
    """The environment's reset raised or hung on a record."""


@dataclass
class Opening:
    """record -> the text that opens its episode, in place of the prompt field (None: not
    known; the prompt field is counted instead)."""

    describe: str
    """How the prompt is made, for the message: 'and the tools' declarations before it'."""
    first_message: Callable[[Mapping[str, Any]], Any]
    close: Callable[[], None] = field(default=lambda: None)


def tools_opening(instructions: str, prompt_field: str) -> Opening:
    """The tools environment's first message: the declarations, then the prompt."""
    from rollout.harness.environments.tools import first_message

    return Opening(
        "and the tools' declarations before it",
        lambda record: first_message(instructions, record[prompt_field]),
    )


def environment_opening(config: RunConfig, factory: Callable[..., Any]) -> Opening | None:
    """The first observation of a plugin or built-in multi-turn environment (None where it is
    not opened at plan time: see the module docstring)."""
    from rollout.harness.memory import takes_memory

    spec = config.environment
    if spec is None or spec.is_single_turn or spec.is_tools or spec.is_agent:
        return None
    if spec.isolation == "sidecar" or takes_memory(factory):
        return None
    resetter = _Resetter(config, factory)
    return Opening(
        f"as environment {spec.name!r} opens the episode", resetter, close=resetter.close
    )


class _Resetter:
    """Builds the environment on first use and resets it on one record at a time."""

    def __init__(self, config: RunConfig, factory: Callable[..., Any]):
        spec = config.environment
        assert spec is not None
        self._spec = spec
        self._factory = factory
        self._roles = {
            role: name for role, name in config.data.fields.model_dump().items() if name is not None
        }
        self._environment: Any = None
        self._spent_s = 0.0
        self._warned = False
        self._stuck = False

    def __call__(self, record: Mapping[str, Any]) -> Any:

        if self._stuck:
            return None
        if self._spent_s >= OPENING_BUDGET_S:
            if not self._warned:
                self._warned = True
                log.warning(
                    "environment %r: its first observations were counted for the records its "
                    "resets reached in %.0f s; the rest are checked as their episodes start",
                    self._spec.name,
                    OPENING_BUDGET_S,
                )
            return None
        # What the worker passes: the record's fields, and each mapped role under its own name
        # (rollout.runtime.online.actor.PromptFormat.reward_row).
        row = dict(record)
        for role, name in self._roles.items():
            row[role] = record.get(name)
        try:
            return self._open(row)
        except OpeningFailed:
            # One failure is the plan's error: the records after it are not opened (a reset that
            # fails on every record would otherwise be the same error once per record).
            self._stuck = True
            raise

    def _open(self, row: dict[str, Any]) -> str:
        from rollout.harness.deadline import Overran, Raised, call_with_deadline

        if self._environment is None:
            self._environment = self._build()
        started = time.perf_counter()
        try:
            (observation,) = call_with_deadline(
                lambda: list(self._environment.reset([row], seed=0)),
                self._spec.timeout_s,
                name=f"plan:{self._spec.name}.reset",
            )
        except Overran:
            raise OpeningFailed(
                f"reset did not return within environment.timeout_s = {self._spec.timeout_s}"
            ) from None
        except Raised as error:
            raise OpeningFailed(f"reset raised {type(error.error).__name__}: {error}") from None
        except ValueError as error:  # not exactly one observation back
            raise OpeningFailed(f"reset returned {error}") from None
        finally:
            self._spent_s += time.perf_counter() - started
        if not isinstance(observation, str):
            raise OpeningFailed(
                f"reset returned a {type(observation).__name__} as the observation, not text"
            )
        return observation

    def _build(self) -> Any:
        """The environment with its options, as the worker builds it (a constructor may load
        data: it gets BUILD_TIMEOUT_S, not the per-call timeout_s)."""
        from rollout.harness.deadline import Overran, Raised, call_with_deadline

        try:
            return call_with_deadline(
                lambda: self._factory(**self._spec.options),
                max(BUILD_TIMEOUT_S, self._spec.timeout_s),
                name=f"plan:{self._spec.name}",
            )
        except Overran:
            raise OpeningFailed(
                f"building it did not finish within {max(BUILD_TIMEOUT_S, self._spec.timeout_s)} s"
            ) from None
        except Raised as error:
            raise OpeningFailed(
                f"building it with its options raised {type(error.error).__name__}: {error}"
            ) from None

    def close(self) -> None:
        close = getattr(self._environment, "close", None)
        if callable(close):
            close()
