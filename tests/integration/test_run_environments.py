"""Multi-turn runs for real: `rollout plan` and `rollout run` with [environment] on the tiny model,
an environment plugin file next to the config, faults contained or stopping the run, and learning
through episodes whose environment turns are masked out of the loss."""

from __future__ import annotations

import json

import pytest

from tests.integration.driver import only_run, rollout

pytestmark = pytest.mark.slow

SEVENS_GAME = '''
from rollout.harness.environments.base import StepResult


class SevensGame:
    """Two answers per episode; each earns the share of its characters that are '7'."""

    def __init__(self, nudge="More sevens, please."):
        self.nudge = nudge

    def reset(self, rows, *, seed):
        return [str(row["prompt"]) for row in rows]

    def step(self, episodes, actions):
        return [StepResult(self.nudge, reward=a.count("7") / max(1, len(a))) for a in actions]


class Broken(SevensGame):
    def step(self, episodes, actions):
        raise RuntimeError("the game lost its board")
'''

MULTI_TURN = (
    "rewards=[]",
    "environment.name='./games.py:SevensGame'",
    "environment.max_turns=2",
    "environment.max_observation_tokens=24",
    "data.eval=null",
)


def run_args(*settings: str) -> list[str]:
    args = ["run", "--config", "examples/grpo-tiny.toml"]
    for setting in (*MULTI_TURN, *settings):
        args += ["--set", setting]
    return args


def test_multi_turn_grpo_raises_the_reward_of_its_episodes(workdir):
    (workdir / "examples" / "games.py").write_text(SEVENS_GAME)
    result = rollout(
        workdir,
        *run_args(
            "algorithm.lr=3e-3",
            "algorithm.max_steps=25",
            "algorithm.rollout_batch_size=32",
            "algorithm.num_generations=8",
            "algorithm.minibatch_size=32",
            "generation.max_new_tokens=8",
            "checkpoint.interval=100",
            "data.eval={ path = 'data/arith-eval.jsonl', limit = 16 }",
        ),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    store, record = only_run(workdir)
    rewards = [m.value for m in store.metrics(record.run_id, ["reward/mean"])]
    turns = [m.value for m in store.metrics(record.run_id, ["episode/turns_mean"])]
    assert len(rewards) == 25 and set(turns) == {2.0}  # every episode ran both turns
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.2, rewards  # a return is two turns' shares: up to 2
    # Held out: one greedy episode per eval prompt, before step 1 and after the last.
    held_out = store.metrics(record.run_id, ["eval/reward"])
    assert [m.step for m in held_out] == [0, 25]
    assert held_out[1].value > held_out[0].value + 0.2, held_out


def test_an_environment_that_raises_fails_the_run_naming_it(workdir):
    (workdir / "examples" / "games.py").write_text(SEVENS_GAME)
    result = rollout(
        workdir, *run_args("environment.name='./games.py:Broken'", "algorithm.max_steps=2")
    )
    assert result.returncode == 1
    assert "environment './games.py:Broken': step raised RuntimeError" in result.stderr
    _, record = only_run(workdir)
    assert record.status == "failed" and "the game lost its board" in record.error


def test_with_fail_episode_a_raising_environment_scores_episodes_as_failed(workdir):
    (workdir / "examples" / "games.py").write_text(SEVENS_GAME)
    result = rollout(
        workdir,
        *run_args(
            "environment.name='./games.py:Broken'",
            "environment.on_error='fail_episode'",
            "environment.failure_reward=-1.0",
            "algorithm.max_steps=2",
        ),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    store, record = only_run(workdir)
    failed = [m.value for m in store.metrics(record.run_id, ["episode/failed_fraction"])]
    rewards = [m.value for m in store.metrics(record.run_id, ["reward/mean"])]
    assert failed == [1.0, 1.0] and rewards == [-1.0, -1.0]
    logs = rollout(workdir, "logs", "tail", record.run_id)
    assert "episode failed, scored -1" in logs.stdout and "lost its board" in logs.stdout


def test_a_changed_environment_file_makes_the_plan_stale(workdir):
    games = workdir / "examples" / "games.py"
    games.write_text(SEVENS_GAME)
    args = ["plan", "--config", "examples/grpo-tiny.toml", "-o", "env.lock"]
    for setting in MULTI_TURN:
        args += ["--set", setting]
    planned = rollout(workdir, *args)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    games.write_text(SEVENS_GAME + "\n# edited\n")
    result = rollout(workdir, "run", "--plan", "env.lock")
    assert result.returncode == 2
    assert "games.py" in result.stderr and "environment.name" in result.stderr


REMEMBERING = '''
import os

from rollout.harness.environments.base import StepResult


class Remembers:
    """One entry per step; logs how many it finds at each step; stops the run once at step 3."""

    def __init__(self, memory):
        self.memory = memory

    def reset(self, rows, *, seed):
        player = self.memory.agent("player")
        with open("seen.log", "a") as log:
            log.write(f"{self.memory.step} {len(player)}\\n")
        if self.memory.step == 3 and not os.path.exists("stopped-once"):
            open("stopped-once", "w").close()
            raise RuntimeError("stopping once")
        player.add(f"played step {self.memory.step}", rows=len(rows))
        return [str(row["prompt"]) for row in rows]

    def step(self, episodes, actions):
        return [StepResult(reward=len(a) / 8, done=True) for a in actions]
'''


def test_episodic_memory_is_checkpointed_restored_on_resume_and_shown(workdir):
    (workdir / "examples" / "remember.py").write_text(REMEMBERING)
    args = ["plan", "--config", "examples/grpo-tiny.toml", "-o", "memory.lock"]
    for setting in (
        "rewards=[]",
        "environment.name='./remember.py:Remembers'",
        "environment.max_turns=2",
        "data.eval=null",
        "algorithm.max_steps=4",
        "checkpoint.interval=2",
    ):
        args += ["--set", setting]
    assert rollout(workdir, *args).returncode == 0
    first = rollout(workdir, "run", "--plan", "memory.lock")
    assert first.returncode == 1 and "stopping once" in first.stderr
    resumed = rollout(workdir, "run", "--plan", "memory.lock")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    seen = (workdir / "seen.log").read_text().split("\n")
    # step 3 failed with 2 entries; resumed from the step-2 checkpoint, it finds those 2 again
    assert seen[:-1] == ["1 0", "2 1", "3 2", "3 2", "4 3"]
    _, record = only_run(workdir)
    shown = rollout(workdir, "memory", "show", record.run_id, "player", "--format", "json")
    assert shown.returncode == 0, shown.stderr
    entries = json.loads(shown.stdout)["entries"]
    assert [(e["step"], e["text"]) for e in entries] == [
        (step, f"played step {step}") for step in (1, 2, 3, 4)
    ]
    older = rollout(workdir, "memory", "show", record.run_id, "player", "--step", "2")
    assert older.returncode == 0 and "played step 2" in older.stdout
    assert "played step 3" not in older.stdout
    missing = rollout(workdir, "memory", "show", record.run_id, "nobody")
    assert missing.returncode == 2 and "agents: player" in missing.stderr


@pytest.mark.parametrize(
    ("kind", "settings"),
    [
        # PPO with the KL to the reference in the token rewards, and per-turn rewards.
        (
            "ppo",
            (
                "algorithm.kl_coef=0.05",
                "algorithm.kl_penalty='reward'",
                "algorithm.critic='value_head'",
                "environment.advantage='turn'",
                "environment.options={ low = 1, high = 8, shaping = 0.2 }",
            ),
        ),
        ("reinforce_pp", ("algorithm.baseline='group'",)),
    ],
)
def test_the_per_token_kinds_play_guess_number(workdir, kind, settings):
    """PPO and REINFORCE++ train on multi-turn episodes: two steps of guess_number on the tiny
    model, the environment's replies in each episode and out of the loss."""
    args = ["run", "--config", "examples/guess-number.toml"]
    for setting in (
        'model={ builtin = "tiny-llama" }',
        f"algorithm.kind='{kind}'",
        "data.system_prompt=null",
        "data.eval=null",
        "run.eval_interval=null",
        "algorithm.max_steps=2",
        "algorithm.rollout_batch_size=8",
        "algorithm.num_generations=4",
        "algorithm.minibatch_size=8",
        *settings,
    ):
        args += ["--set", setting]
    result = rollout(workdir, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    store, record = only_run(workdir)
    names = ["reward/mean", "episode/turns_mean", "train/loss"]
    if kind == "ppo":
        names += ["train/value_loss", "train/reward_kl"]
    for name in names:
        assert [m.step for m in store.metrics(record.run_id, [name])] == [1, 2], name
    turns = [m.value for m in store.metrics(record.run_id, ["episode/turns_mean"])]
    assert all(t > 1 for t in turns), turns  # the random model seldom guesses in one
