"""PPO and REINFORCE++ through `rollout run` (real torchrun, SQLite, checkpoints) on the tiny
model: both raise the reward on a task it can learn, PPO's critic fits its returns, and a PPO
run with a value head resumes from its checkpoint, head included."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.driver import only_run, rollout

pytestmark = pytest.mark.slow

LEARN = [
    "--set",
    "rewards=[{ fn = './sevens.py:sevens' }]",
    "--set",
    "data.use_chat_template=false",
    "--set",
    "algorithm.lr=3e-3",
    "--set",
    "algorithm.max_steps=25",
    "--set",
    "algorithm.rollout_batch_size=32",
    "--set",
    "algorithm.kl_coef=0",
    "--set",
    "generation.max_new_tokens=8",
    "--set",
    "checkpoint.interval=100",
]


def _series(workdir: Path, name: str) -> list[float]:
    store, record = only_run(workdir)
    assert record.status == "finished"
    return [m.value for m in store.metrics(record.run_id, [name])]


def _first_and_last(values: list[float]) -> tuple[float, float]:
    return sum(values[:5]) / 5, sum(values[-5:]) / 5


def test_ppo_raises_the_reward_and_its_critic_fits(workdir):
    result = rollout(
        workdir,
        "run",
        "--config",
        "examples/ppo-tiny.toml",
        *LEARN,
        "--set",
        "algorithm.critic_lr=3e-3",
        "--set",
        "algorithm.minibatch_size=16",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rewards = _series(workdir, "reward/mean")
    assert len(rewards) == 25
    first, last = _first_and_last(rewards)
    assert last > first + 0.1, rewards
    # Once the policy settles, the returns stop moving and the critic catches up with them.
    value_loss = _series(workdir, "train/value_loss")
    first, last = _first_and_last(value_loss)
    assert last < first, value_loss
    (checkpoint,) = (workdir / "runs").glob("*/checkpoints/step-*")
    assert (checkpoint / "critic" / "weights.safetensors").is_file()
    assert (checkpoint / "critic" / "optimizer.safetensors").is_file()


def test_reinforce_pp_raises_the_reward(workdir):
    result = rollout(
        workdir,
        "run",
        "--config",
        "examples/reinforce-pp-tiny.toml",
        *LEARN,
        "--set",
        "algorithm.num_generations=8",
        "--set",
        "algorithm.minibatch_size=32",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    first, last = _first_and_last(rewards := _series(workdir, "reward/mean"))
    assert last > first + 0.1, rewards


def test_ppo_with_a_value_head_resumes_head_and_all(workdir):
    common = [
        "--set",
        'algorithm.critic="value_head"',
        "--set",
        'algorithm.kl_penalty="loss"',
        "--set",
        "checkpoint.interval=1",
        "--set",
        "generation.max_new_tokens=4",
    ]
    first = rollout(
        workdir,
        "run",
        "--config",
        "examples/ppo-tiny.toml",
        *common,
        "--set",
        "algorithm.max_steps=2",
    )
    assert first.returncode == 0, first.stdout + first.stderr
    run_dir = next((workdir / "runs").glob("ppo-tiny-*"))
    head = run_dir / "checkpoints" / "step-000002" / "value_head" / "weights.safetensors"
    assert head.is_file()

    # As if it had stopped at its last checkpoint (a finished run is not started again), the
    # same plan resumes from it (step 2 of 2), head included.
    store, record = only_run(workdir)
    store.set_status(record.run_id, "stopped")
    store.close()
    second = rollout(workdir, "run", "--plan", str(run_dir / "plan.lock"))
    assert second.returncode == 0, second.stdout + second.stderr
    _, record = only_run(workdir)
    assert record.status == "finished"
    logs = rollout(workdir, "logs", "tail", record.run_id)
    assert "resumed from" in logs.stdout
