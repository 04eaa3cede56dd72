"""Call an environment plugin safely: each call under a time limit, every result checked.

What an environment does wrong (raises, hangs past `timeout_s`, returns the wrong number of
results or a result of the wrong type, a reward that is not a finite number, an observation
that is not text) is an EnvironmentFault naming the environment, the episode and the problem.
With on_error = "stop" it stops the step; with "fail_episode" the episodes it concerns end there,
scored as failed (`failure_reward`), the reason kept for the logs, and the others go on. An
observation longer than `max_observation_chars` is cut there (a flooding environment cannot
exhaust memory or the context; the runtime cuts its tokens again).

reset is never contained: an episode that cannot start has nothing to train on, so a failing
reset always stops the step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from rollout.harness.deadline import Overran, Raised, call_with_deadline
from rollout.harness.environments.base import Environment, Row, StepResult

OnError = Literal["stop", "fail_episode"]


class EnvironmentFault(Exception):
    """An environment failed. episode: the episode to blame (index in the reset batch), if one."""

    def __init__(self, message: str, *, environment: str, episode: int | None = None):
        super().__init__(message)
        self.environment = environment
        self.episode = episode


@dataclass(frozen=True)
class Failed:
    """An episode ended by its environment's fault (on_error = "fail_episode")."""

    reason: str


class EnvironmentRunner:
    def __init__(
        self,
        environment: Environment,
        *,
        name: str,
        timeout_s: float,
        on_error: OnError = "stop",
        max_observation_chars: int = 65536,
    ):
        self.environment = environment
        self.name = name
        self.timeout_s = timeout_s
        self.on_error = on_error
        self.max_observation_chars = max_observation_chars

    def reset(self, rows: Sequence[Row], *, seed: int) -> list[str]:
        # Fresh dicts: a plugin that mutates its rows cannot change the data the run keeps.
        fresh = [dict(row) for row in rows]
        first = self._call("reset", lambda: self.environment.reset(fresh, seed=seed), len(rows))
        if not isinstance(first, list) or len(first) != len(rows):
            raise self._fault(
                f"reset returned {_describe(first)} for {len(rows)} rows: it must return a list "
                "of one first observation (a str) per row"
            )
        for episode, observation in enumerate(first):
            if not isinstance(observation, str):
                raise self._fault(
                    f"reset's observation {episode} is {type(observation).__name__}, not str",
                    episode,
                )
        return [self._cut(observation) for observation in first]

    def step(self, episodes: Sequence[int], actions: Sequence[str]) -> list[StepResult | Failed]:
        """One StepResult per episode, or Failed where the environment is to blame (with
        on_error = "fail_episode"; with "stop" the fault is raised)."""
        episodes, actions = list(episodes), list(actions)
        try:
            results = self._call(
                "step", lambda: self.environment.step(episodes, actions), len(episodes)
            )
            if not isinstance(results, list) or len(results) != len(episodes):
                raise self._fault(
                    f"step returned {_describe(results)} for {len(episodes)} episodes: it must "
                    "return a list of one StepResult per episode, in order"
                )
        except EnvironmentFault as fault:
            if self.on_error == "stop":
                raise
            return [Failed(str(fault))] * len(episodes)
        checked: list[StepResult | Failed] = []
        for episode, result in zip(episodes, results, strict=True):
            problem = _problem(result)
            if problem is None:
                checked.append(self._cut_result(result))
                continue
            fault = self._fault(f"step's result for episode {episode} {problem}", episode)
            if self.on_error == "stop":
                raise fault
            checked.append(Failed(str(fault)))
        return checked

    def close(self) -> None:
        close = getattr(self.environment, "close", None)
        if callable(close):
            close()

    def _call(self, what: str, fn: Any, count: int) -> Any:
        if getattr(self.environment, "enforces_deadline", False):
            # A sidecar kills a call past timeout_s itself; its errors name the environment
            # and the episodes (rollout.runtime.sidecar_environment).
            try:
                return fn()
            except Exception as error:
                # A reset's bisection names the row it fails on alone (its `sample`).
                episode = getattr(error, "sample", None)
                raise self._fault(f"{what} failed: {error}", episode) from error
        try:
            return call_with_deadline(fn, self.timeout_s, name=f"environment-{self.name}")
        except Overran:
            raise self._fault(
                f"{what} did not return within {self.timeout_s:g} s for {count} episodes; make it "
                "faster or raise environment.timeout_s"
            ) from None
        except Raised as raised:
            error = raised.error
            raise self._fault(f"{what} raised {type(error).__name__}: {error}") from error

    def _fault(self, problem: str, episode: int | None = None) -> EnvironmentFault:
        return EnvironmentFault(
            f"environment {self.name!r}: {problem}", environment=self.name, episode=episode
        )

    def _cut(self, text: str) -> str:
        return text[: self.max_observation_chars]

    def _cut_result(self, result: StepResult) -> StepResult:
        if len(result.observation) <= self.max_observation_chars:
            return result
        return replace(
            result, observation=self._cut(result.observation), reward=float(result.reward)
        )


def _problem(result: Any) -> str | None:
    """What is wrong with one step result, or None."""
    if not isinstance(result, StepResult):
        return f"is {type(result).__name__}, not a StepResult"
    if not isinstance(result.observation, str):
        return f"has an observation of type {type(result.observation).__name__}, not str"
    if isinstance(result.reward, bool) or not isinstance(result.reward, (int, float)):
        return f"has a reward of type {type(result.reward).__name__}, not a number"
    if not math.isfinite(result.reward):
        return f"has the reward {result.reward}, not a finite number"
    if not isinstance(result.done, bool):
        return f"has done = {result.done!r}, not True or False"
    if result.role not in ("user", "tool"):
        return f"has role = {result.role!r}, not 'user' or 'tool'"
    return None


def _describe(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"a {type(value).__name__}"
