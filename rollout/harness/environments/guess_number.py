"""Guess-the-number: a deterministic multi-turn text game.

The environment picks a secret integer in [low, high] for each episode (from the row's `secret`
field when the data has one, else drawn from the seed and the row, so the G episodes of one row
in a GRPO group play the same game) and tells the model the range. Every answer's last integer is its guess; the environment answers "higher" or "lower",
until the guess is right (reward 1, done) or the turns run out (the harness ends the episode, and
the return stays 0). A guess that is not a number is told so and costs its turn.

`shaping` adds a small reward per turn for guesses that move closer to the secret, so that even a
model that seldom wins outright gets a signal.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence

from rollout.harness.environments.base import Row, StepResult

_INTEGER = re.compile(r"-?\d+")


class GuessNumber:
    def __init__(self, *, low: int = 1, high: int = 10, shaping: float = 0.0):
        if low >= high:
            raise ValueError(f"guess_number: low ({low}) must be below high ({high})")
        if shaping < 0:
            raise ValueError(f"guess_number: shaping must be >= 0, got {shaping}")
        self.low, self.high, self.shaping = low, high, shaping
        self._secrets: list[int] = []
        self._last_distance: list[int | None] = []

    def reset(self, rows: Sequence[Row], *, seed: int) -> list[str]:
        self._secrets = []
        for row in rows:
            if "secret" in row:
                secret = row["secret"]
            else:
                key = json.dumps(row, sort_keys=True, default=str)
                secret = random.Random(f"{seed}:{key}").randint(self.low, self.high)
            if not isinstance(secret, int) or not self.low <= secret <= self.high:
                raise ValueError(
                    f"guess_number: secret {secret!r} is not an integer in [{self.low}, "
                    f"{self.high}]"
                )
            self._secrets.append(secret)
        self._last_distance = [None] * len(rows)
        return [f"Guess my number, {self.low} to {self.high}." for _ in rows]

    def step(self, episodes: Sequence[int], actions: Sequence[str]) -> list[StepResult]:
        return [
            self._one(episode, action) for episode, action in zip(episodes, actions, strict=True)
        ]

    def _one(self, episode: int, action: str) -> StepResult:
        secret = self._secrets[episode]
        found = _INTEGER.findall(action)
        if not found:
            return StepResult(
                "That is not a number. Answer with one number.", info={"valid": False}
            )
        guess = int(found[-1])
        if guess == secret:
            return StepResult(reward=1.0, done=True, info={"solved": True, "guess": guess})
        distance = abs(guess - secret)
        closer = self._last_distance[episode]
        reward = self.shaping if closer is not None and distance < closer else 0.0
        self._last_distance[episode] = distance
        hint = "higher" if guess < secret else "lower"
        return StepResult(
            f"No, {guess} is wrong: guess {hint}.", reward=reward, info={"guess": guess}
        )
