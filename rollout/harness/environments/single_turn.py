"""The single-turn environment: one prompt, one answer, scored by the run's [[rewards]].

This is what every online run without an [environment] section does (the actor's own fast path,
rollout.runtime.online.actor); as an environment it lets a run state it explicitly and lets the
episode machinery be checked against that path on the same seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rollout.harness.environments.base import Row, StepResult

Score = Callable[[list[str], list[str], list[Row]], list[float]]
"""(prompts, completions, rows) -> one reward per completion (a RewardRunner's total)."""


class SingleTurn:
    def __init__(self, score: Score, prompt_field: str):
        self._score = score
        self._prompt_field = prompt_field
        self._rows: list[Row] = []

    def reset(self, rows: Sequence[Row], *, seed: int) -> list[str]:
        self._rows = list(rows)
        return [str(row[self._prompt_field]) for row in rows]

    def step(self, episodes: Sequence[int], actions: Sequence[str]) -> list[StepResult]:
        rows = [self._rows[i] for i in episodes]
        prompts = [str(row[self._prompt_field]) for row in rows]
        rewards = self._score(prompts, list(actions), rows)
        return [StepResult(reward=reward, done=True) for reward in rewards]
