"""Gymnasium environments with text observations, as rollout environments.

One Gymnasium environment per episode (`gymnasium.make(env_id, **kwargs)`), reset with the
run's seed plus the episode's index. Observations must be text: a `str` observation is used as
is; otherwise the environment must render text (render_mode = "ansi"). Actions: for a Discrete
space the answer's last integer (an answer without one, or out of range, is told so and costs
its turn); for a Text space the answer itself.

Gymnasium is imported when the environment is built: `pip install 'rollout[gym]'`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from rollout.harness.environments.base import Row, StepResult

_INTEGER = re.compile(r"-?\d+")


class GymnasiumText:
    def __init__(self, *, env_id: str, kwargs: dict[str, Any] | None = None):
        try:
            import gymnasium
        except ImportError as error:
            raise ImportError(
                "the gymnasium environment needs gymnasium: pip install 'rollout[gym]'"
            ) from error
        self._gym = gymnasium
        self.env_id = env_id
        self.kwargs = dict(kwargs or {})
        gymnasium.spec(env_id)  # an unknown id fails here, when the run builds it
        self._envs: list[Any] = []

    def reset(self, rows: Sequence[Row], *, seed: int) -> list[str]:
        self.close()
        self._envs = [self._gym.make(self.env_id, **self.kwargs) for _ in rows]
        first = []
        for i, env in enumerate(self._envs):
            observation, _info = env.reset(seed=seed + i)
            first.append(self._text(env, observation))
        return first

    def step(self, episodes: Sequence[int], actions: Sequence[str]) -> list[StepResult]:
        return [self._one(self._envs[i], text) for i, text in zip(episodes, actions, strict=True)]

    def close(self) -> None:
        for env in self._envs:
            env.close()
        self._envs = []

    def _one(self, env: Any, text: str) -> StepResult:
        action, problem = self._action(env.action_space, text)
        if problem is not None:
            return StepResult(problem, info={"valid": False})
        observation, reward, terminated, truncated, info = env.step(action)
        return StepResult(
            self._text(env, observation),
            float(reward),
            bool(terminated or truncated),
            {k: v for k, v in info.items() if isinstance(v, (str, int, float, bool))},
        )

    def _action(self, space: Any, text: str) -> tuple[Any, str | None]:
        spaces = self._gym.spaces
        if isinstance(space, spaces.Discrete):
            found = _INTEGER.findall(text)
            low, high = int(space.start), int(space.start + space.n - 1)
            if not found or not low <= int(found[-1]) <= high:
                return None, f"Answer with one integer action from {low} to {high}."
            return int(found[-1]), None
        if isinstance(space, spaces.Text):
            return text, None
        raise TypeError(
            f"gymnasium environment {self.env_id!r} has a {type(space).__name__} action space: "
            "only Discrete and Text actions can be written as text"
        )

    def _text(self, env: Any, observation: Any) -> str:
        if isinstance(observation, str):
            return observation
        if getattr(env, "render_mode", None) == "ansi":
            return str(env.render())
        raise TypeError(
            f"gymnasium environment {self.env_id!r} observes {type(observation).__name__}, not "
            "text: use an environment with str observations or render_mode = 'ansi'"
        )
