"""An environment plugin in a sidecar: reset and step through the child, a reset retried after a
crash, a hung step killed and failed as on_error says (its episodes lost until the next reset),
and [environment] isolation through validate and plan."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout import ConfigError
from rollout.config import validate_config
from rollout.errors import PlanError
from rollout.harness.environments.base import StepResult
from rollout.harness.environments.runner import EnvironmentFault, EnvironmentRunner, Failed
from rollout.planner.builder import build_plan
from rollout.plugins.resolve import resolve_plugin
from rollout.plugins.sidecar.host import SidecarHost, server_argv
from rollout.runtime.sidecar_environment import SidecarEnvironment

GAMES = '''
import os
import time
from pathlib import Path

from rollout.harness.environments.base import StepResult

HERE = Path(__file__).parent


class Counter:
    """Each answer earns its length over `scale`; the episode ends after the second turn."""

    def __init__(self, scale=10):
        self.scale = scale
        self.turns = {}

    def reset(self, rows, *, seed):
        if any(row["prompt"] == "HANG" for row in rows):
            while True:
                pass
        if (HERE / "crash-reset").exists():
            (HERE / "crash-reset").unlink()
            os._exit(9)
        self.turns = {i: 0 for i in range(len(rows))}
        return [f"{row['prompt']} (seed {seed})" for row in rows]

    def step(self, episodes, actions):
        if (HERE / "hang-step").exists():
            (HERE / "hang-step").unlink()
            while True:
                pass
        results = []
        for episode, action in zip(episodes, actions):
            self.turns[episode] += 1  # a KeyError for an episode this child never reset
            results.append(
                StepResult(f"turn {self.turns[episode]}", reward=len(action) / self.scale,
                           done=self.turns[episode] == 2, info={"turn": self.turns[episode]})
            )
        return results


class Remembers(Counter):
    def __init__(self, memory=None):
        super().__init__()
'''

ROWS = [{"prompt": "a"}, {"prompt": "b"}]


@pytest.fixture
def games(tmp_path: Path) -> Path:
    (tmp_path / "games.py").write_text(GAMES)
    return tmp_path


@pytest.fixture
def runner(games):
    made = []

    def make(on_error: str = "stop", timeout_s: float = 2.0) -> EnvironmentRunner:
        ref = "./games.py:Counter"
        identity = resolve_plugin(
            ref,
            base_dir=games,
            used_by="environment.name",
            builtins={},
            group="rollout.environments",
        ).identity
        host = SidecarHost(
            server_argv(None, ref, identity.model_dump_json(), build={"scale": 4}), name="counter"
        )
        made.append(SidecarEnvironment(host, timeout_s=timeout_s))
        return EnvironmentRunner(made[-1], name="counter", timeout_s=timeout_s, on_error=on_error)

    yield make
    for environment in made:
        environment.close()


def test_reset_and_step_go_through_the_sidecar(runner):
    env = runner()
    assert env.reset(ROWS, seed=3) == ["a (seed 3)", "b (seed 3)"]
    first = env.step([0, 1], ["abcd", "ab"])
    assert first == [
        StepResult("turn 1", reward=1.0, done=False, info={"turn": 1}),
        StepResult("turn 1", reward=0.5, done=False, info={"turn": 1}),
    ]
    assert [r.done for r in env.step([0, 1], ["x", "y"])] == [True, True]  # state is kept


def test_a_reset_that_crashes_is_retried_in_a_fresh_sidecar(runner, games):
    env = runner()
    (games / "crash-reset").touch()
    assert env.reset(ROWS, seed=0) == ["a (seed 0)", "b (seed 0)"]
    assert env.environment.host.restarts == 1


def test_a_hung_step_is_killed_its_episodes_fail_and_the_next_reset_starts_afresh(runner, games):
    env = runner(on_error="fail_episode")
    env.reset(ROWS, seed=0)
    (games / "hang-step").touch()
    failed = env.step([0, 1], ["a", "b"])
    assert all(isinstance(result, Failed) for result in failed)
    assert "'counter'" in failed[0].reason and "no answer within 2 s (killed)" in failed[0].reason
    # Not resubmitted: a fresh child has no episodes to step. Later steps say why at once.
    later = env.step([0], ["c"])
    assert "stopped during an earlier step" in later[0].reason
    assert env.reset(ROWS, seed=1) == ["a (seed 1)", "b (seed 1)"]
    assert env.step([0], ["abcd"])[0] == StepResult("turn 1", reward=1.0, info={"turn": 1})


def test_with_on_error_stop_a_hung_step_stops_naming_the_environment(runner, games):
    env = runner()
    env.reset(ROWS, seed=0)
    (games / "hang-step").touch()
    with pytest.raises(EnvironmentFault) as caught:
        env.step([0, 1], ["a", "b"])
    assert "environment 'counter': step failed" in str(caught.value)
    assert "episodes 0, 1" in str(caught.value)


def test_a_reset_that_hangs_stops_naming_the_row_it_hangs_on_alone(runner):
    env = runner(timeout_s=0.5)
    rows = [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "HANG", "id": 17}, {"prompt": "d"}]
    with pytest.raises(EnvironmentFault) as caught:
        env.reset(rows, seed=0)
    message = str(caught.value)
    assert caught.value.episode == 2
    assert "failed on a reset of 4 episodes, and on row 2 (row id 17) alone" in message
    assert "no answer within 0.5 s (killed)" in message
    assert env.reset(ROWS, seed=1) == ["a (seed 1)", "b (seed 1)"]  # the next reset starts afresh


def sidecar_config(base: dict[str, Any], **environment: Any) -> dict[str, Any]:
    raw = copy.deepcopy(base)
    raw["environment"] = {
        "name": "./games.py:Counter",
        "max_turns": 2,
        "isolation": "sidecar",
        **environment,
    }
    raw.pop("rewards")
    raw["data"]["fields"].pop("answer")
    raw["data"]["use_chat_template"] = True
    return raw


def config_issues(raw: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        validate_config(raw)
    return {issue.path: str(issue) for issue in caught.value.issues}


def test_validate_refuses_a_sidecar_for_a_built_in_environment_and_python_without_one(
    base_config,
):
    raw = copy.deepcopy(base_config)
    raw["environment"] = {"name": "single_turn", "isolation": "sidecar"}
    assert "only a plugin environment" in config_issues(raw)["environment.isolation"]
    raw = sidecar_config(base_config, isolation="in_process", python=sys.executable)
    assert "environment.python" in config_issues(raw)


def test_plan_health_checks_the_environment_sidecar_and_records_its_python(
    config_file, base_config, games
):
    plan = build_plan(config_file(sidecar_config(base_config, python=sys.executable)))
    assert plan.config.environment.isolation == "sidecar"
    assert plan.environment_python == sys.executable


def test_plan_refuses_a_sidecar_whose_options_break_its_environment(
    config_file, base_config, games
):
    raw = sidecar_config(base_config, options={"scale": 1})
    (games / "games.py").write_text(GAMES.replace("self.scale = scale", "1 / 0"))
    with pytest.raises(PlanError) as caught:
        build_plan(config_file(raw))
    message = {i.path: str(i) for i in caught.value.issues}["environment.isolation"]
    assert "health check" in message and "ZeroDivisionError" in message


def test_plan_refuses_a_sidecar_for_an_environment_with_episodic_memory(
    config_file, base_config, games
):
    raw = sidecar_config(base_config, name="./games.py:Remembers")
    with pytest.raises(PlanError) as caught:
        build_plan(config_file(raw))
    assert (
        "episodic memory" in {i.path: str(i) for i in caught.value.issues}["environment.isolation"]
    )
