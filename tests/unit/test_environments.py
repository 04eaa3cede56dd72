"""Environments: the built-ins (guess_number, gymnasium), the runner that contains what a plugin
does wrong, and per-turn advantages."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from rollout.algorithms.advantages import group_advantages, rloo_advantages, turn_advantages
from rollout.harness.environments.base import StepResult
from rollout.harness.environments.guess_number import GuessNumber
from rollout.harness.environments.runner import EnvironmentFault, EnvironmentRunner, Failed

# --- guess_number -------------------------------------------------------------------------------


def test_guess_number_answers_higher_lower_and_ends_on_the_secret():
    game = GuessNumber(low=1, high=10)
    (intro,) = game.reset([{"secret": 7}], seed=0)
    assert intro == "Guess my number, 1 to 10."
    low = game.step([0], ["I guess 3"])[0]
    assert (low.done, low.reward) == (False, 0.0) and "higher" in low.observation
    high = game.step([0], ["maybe 2 or 9"])[0]  # the last number is the guess
    assert "lower" in high.observation and high.info["guess"] == 9
    right = game.step([0], ["7"])[0]
    assert right.done and right.reward == 1.0 and right.info["solved"]


def test_guess_number_tells_a_non_number_so():
    game = GuessNumber()
    game.reset([{"secret": 4}], seed=0)
    result = game.step([0], ["no idea"])[0]
    assert not result.done and result.reward == 0.0 and "not a number" in result.observation


def test_guess_number_draws_one_secret_per_row_so_a_group_plays_one_game():
    game = GuessNumber(low=1, high=1000)
    rows = [{"prompt": "a"}] * 4 + [{"prompt": "b"}] * 4
    game.reset(rows, seed=3)
    secrets = game._secrets
    assert len(set(secrets[:4])) == 1 and len(set(secrets[4:])) == 1
    assert secrets[0] != secrets[4]  # 1 in 1000 to collide: the rows differ
    again = GuessNumber(low=1, high=1000)
    again.reset(rows, seed=3)
    assert again._secrets == secrets  # repeatable from the seed
    again.reset(rows, seed=4)
    assert again._secrets != secrets


def test_guess_number_shaping_rewards_moving_closer_only():
    game = GuessNumber(low=1, high=100, shaping=0.1)
    game.reset([{"secret": 50}], seed=0)
    assert game.step([0], ["10"])[0].reward == 0.0  # no earlier guess to be closer than
    assert game.step([0], ["40"])[0].reward == pytest.approx(0.1)
    assert game.step([0], ["90"])[0].reward == 0.0  # further away


def test_guess_number_refuses_a_secret_out_of_range():
    game = GuessNumber(low=1, high=5)
    with pytest.raises(ValueError, match="secret 9"):
        game.reset([{"secret": 9}], seed=0)
    with pytest.raises(ValueError, match="low"):
        GuessNumber(low=5, high=5)


# --- the runner ---------------------------------------------------------------------------------


class Scripted:
    """An environment whose step does what the test says."""

    def __init__(self, step):
        self._step = step

    def reset(self, rows, *, seed):
        return [f"start {i}" for i in range(len(rows))]

    def step(self, episodes, actions):
        return self._step(episodes, actions)


def runner(step, on_error="stop", **kwargs) -> EnvironmentRunner:
    return EnvironmentRunner(
        Scripted(step), name="scripted", timeout_s=2.0, on_error=on_error, **kwargs
    )


def boom(episodes, actions):
    raise RuntimeError("the game crashed")


def test_a_raising_environment_stops_the_step_naming_it():
    with pytest.raises(
        EnvironmentFault, match="environment 'scripted': step raised RuntimeError: the game crashed"
    ):
        runner(boom).step([0, 1], ["a", "b"])


def test_with_fail_episode_a_raising_environment_fails_the_episodes_of_that_call():
    results = runner(boom, on_error="fail_episode").step([0, 1], ["a", "b"])
    assert all(isinstance(r, Failed) and "the game crashed" in r.reason for r in results)


def test_a_hanging_environment_is_given_up_on_after_its_timeout():
    release = threading.Event()

    def hang(episodes, actions):
        release.wait(30)
        return [StepResult()] * len(episodes)

    began = time.monotonic()
    fast = EnvironmentRunner(Scripted(hang), name="slow", timeout_s=0.3, on_error="fail_episode")
    results = fast.step([0], ["a"])
    release.set()
    assert time.monotonic() - began < 5
    assert isinstance(results[0], Failed) and "did not return within 0.3 s" in results[0].reason


def test_the_wrong_number_of_results_is_a_fault():
    with pytest.raises(EnvironmentFault, match="step returned a list of 1 for 2 episodes"):
        runner(lambda e, a: [StepResult()]).step([0, 1], ["a", "b"])


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ((1.0, False), "is tuple, not a StepResult"),
        (StepResult(reward=math.nan), "has the reward nan"),
        (StepResult(reward="1"), "reward of type str"),
        (StepResult(observation=3), "observation of type int"),
        (StepResult(done="yes"), "done = 'yes'"),
    ],
)
def test_one_malformed_result_fails_only_its_episode(bad, problem):
    def step(episodes, actions):
        return [StepResult("fine"), bad]

    results = runner(step, on_error="fail_episode").step([3, 5], ["a", "b"])
    assert results[0] == StepResult("fine")
    assert isinstance(results[1], Failed) and "episode 5" in results[1].reason
    assert problem in results[1].reason
    with pytest.raises(EnvironmentFault, match="episode 5") as stopped:
        runner(step).step([3, 5], ["a", "b"])
    assert stopped.value.episode == 5


def test_a_flooding_observation_is_cut():
    flood = "x" * 1_000_000
    results = runner(lambda e, a: [StepResult(flood)], max_observation_chars=100).step([0], ["a"])
    assert results[0].observation == "x" * 100


def test_a_failing_reset_always_stops():
    class BadReset(Scripted):
        def reset(self, rows, *, seed):
            return "one string"

    fails = EnvironmentRunner(BadReset(None), name="bad", timeout_s=1, on_error="fail_episode")
    with pytest.raises(EnvironmentFault, match="reset returned a str for 2 rows"):
        fails.reset([{}, {}], seed=0)


def test_the_runner_gives_the_environment_copies_of_the_rows():
    class Mutating(Scripted):
        def reset(self, rows, *, seed):
            rows[0]["prompt"] = "changed"
            return ["x"]

    row = {"prompt": "kept"}
    EnvironmentRunner(Mutating(None), name="m", timeout_s=1).reset([row], seed=0)
    assert row == {"prompt": "kept"}


# --- per-turn advantages ------------------------------------------------------------------------


def test_turn_advantages_of_one_turn_are_the_episode_estimators():
    returns = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 3.0, 0.0, 1.0])
    column = returns[:, None]
    torch.testing.assert_close(turn_advantages(column, 4)[:, 0], group_advantages(returns, 4))
    torch.testing.assert_close(
        turn_advantages(column, 4, baseline="leave_one_out")[:, 0], rloo_advantages(returns, 4)
    )


def test_turn_advantages_take_each_turns_return_to_go_against_the_group():
    # Two episodes of one group: rewards (0, 1) and (0.5,); returns 1 and 0.5, mean 0.75.
    to_go = torch.tensor([[1.0, 1.0], [0.5, 0.0]])
    got = turn_advantages(to_go, 2, scale="none")
    torch.testing.assert_close(got[0], torch.tensor([0.25, 0.25]))
    assert got[1, 0].item() == pytest.approx(-0.25)
    std = torch.tensor([1.0, 0.5]).std().item()
    scaled = turn_advantages(torch.tensor([[1.0, 0.0], [0.5, 0.0]]), 2)
    assert scaled[0, 1].item() == pytest.approx(-0.75 / (std + 1e-6))
