"""The Gymnasium adapter: a text environment registered here, played through GymnasiumText."""

from __future__ import annotations

import string
from typing import ClassVar

import pytest

from rollout.harness.environments.gymnasium_text import GymnasiumText

gymnasium = pytest.importorskip("gymnasium", reason="pip install 'rollout[gym]'")


class Corridor(gymnasium.Env):
    """Walk right (action 1) three times to reach the exit; observations are text."""

    metadata: ClassVar[dict] = {"render_modes": []}

    def __init__(self):
        self.action_space = gymnasium.spaces.Discrete(2)
        self.observation_space = gymnasium.spaces.Text(64, charset=string.printable)
        self.position = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.position = 0
        return "You are at 0 of 3. Actions: 0 = left, 1 = right.", {}

    def step(self, action):
        self.position = max(0, self.position + (1 if action == 1 else -1))
        done = self.position == 3
        return f"You are at {self.position} of 3.", float(done), done, False, {"at": self.position}


gymnasium.register("RolloutTestCorridor-v0", entry_point=Corridor)


def test_a_gymnasium_text_environment_plays_through_the_adapter():
    env = GymnasiumText(env_id="RolloutTestCorridor-v0")
    first = env.reset([{}, {}], seed=0)
    assert first[0].startswith("You are at 0")
    for _ in range(2):
        results = env.step([0, 1], ["1", "go 0"])
    assert results[0].observation == "You are at 2 of 3." and not results[0].done
    assert results[1].observation == "You are at 0 of 3."
    final = env.step([0], ["action 1"])[0]
    assert final.done and final.reward == 1.0 and final.info == {"at": 3}
    invalid = env.step([1], ["7"])[0]
    assert "from 0 to 1" in invalid.observation and invalid.info == {"valid": False}
    env.close()


def test_an_unknown_gymnasium_id_fails_when_built():
    with pytest.raises(gymnasium.error.Error):
        GymnasiumText(env_id="NoSuchEnvironment-v9")
