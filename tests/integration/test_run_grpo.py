"""`rollout run` for real: torchrun workers, SQLite, checkpoints, crashes and resumes.

Each test drives the CLI in a subprocess, as a user would, on the tiny model. They take 15-40 s
each (most of it starting Python and torch twice), so they are marked slow; CI runs them.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rollout.storage import open_store
from tests.integration.driver import only_run, processes_mentioning, rollout, start

pytestmark = pytest.mark.slow


def test_grpo_tiny_runs_end_to_end(workdir):
    result = rollout(
        workdir,
        "run",
        "--config",
        "examples/grpo-tiny.toml",
        "--set",
        "algorithm.max_steps=3",
        "--set",
        "checkpoint.interval=2",
        "--set",
        "data.eval.limit=8",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    store, record = only_run(workdir)
    assert record.status == "finished" and record.last_step == 3
    steps = sorted({m.step for m in store.metrics(record.run_id, ["reward/mean"])})
    assert steps == [1, 2, 3]
    assert [c.step for c in store.checkpoints(record.run_id)] == [2, 3]

    # The policy's weights changed: the last checkpoint differs from the model it started from.
    start = load_file(
        next((workdir / "cache" / "models").glob("tiny-llama-*")) / "model.safetensors"
    )
    final = load_file(
        Path(store.checkpoints(record.run_id)[-1].location) / "model" / "model.safetensors"
    )
    changed = [name for name in start if not (start[name] == final[name]).all()]
    assert len(changed) > len(start) // 2

    logs = rollout(workdir, "logs", "tail", record.run_id)
    assert logs.returncode == 0, logs.stderr
    assert "training grpo for steps 1..3" in logs.stdout
    assert "step 3/3: reward " in logs.stdout and " s/step" in logs.stdout  # progress, per step
    shown = rollout(workdir, "runs", "show", record.run_id)
    assert shown.returncode == 0 and "finished" in shown.stdout


def test_reward_rises_on_a_learnable_task(workdir):
    result = rollout(
        workdir,
        "run",
        "--config",
        "examples/grpo-tiny.toml",
        "--set",
        "rewards=[{ fn = './sevens.py:sevens' }]",
        "--set",
        "data.eval=null",
        "--set",
        "data.use_chat_template=false",
        "--set",
        "algorithm.lr=3e-3",
        "--set",
        "algorithm.max_steps=25",
        "--set",
        "algorithm.rollout_batch_size=32",
        "--set",
        "algorithm.num_generations=8",
        "--set",
        "algorithm.minibatch_size=32",
        "--set",
        "generation.max_new_tokens=8",
        "--set",
        "checkpoint.interval=100",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    store, record = only_run(workdir)
    rewards = [m.value for m in store.metrics(record.run_id, ["reward/mean"])]
    assert len(rewards) == 25
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, rewards


def test_a_failing_reward_fails_the_run_with_its_name_and_sample(workdir):
    result = rollout(
        workdir,
        "run",
        "--config",
        "examples/grpo-tiny.toml",
        "--set",
        "rewards=[{ fn = './flaky.py:flaky' }]",
        "--set",
        "data.eval=null",
    )
    assert result.returncode == 1
    assert "flaky" in result.stderr and "sample 2" in result.stderr
    _, record = only_run(workdir)
    assert record.status == "failed"
    assert "flaky" in record.error and "nan" in record.error.lower()


def test_a_cancelled_run_is_marked_stopped_and_keeps_its_work(workdir):
    """Ctrl-C and the other signals: tests/integration/test_run_ownership.py."""
    host = start(
        workdir,
        "run",
        "--config",
        "examples/grpo-tiny.toml",
        *("--set", "algorithm.max_steps=500", "--set", "data.eval=null"),
    )
    run_id = _wait_for_step(workdir, step=2, process=host)
    cancelled = rollout(workdir, "runs", "cancel", run_id)
    assert cancelled.returncode == 0, cancelled.stderr
    _, stderr = host.communicate(timeout=120)
    assert host.returncode == 130, stderr
    assert "Traceback" not in stderr and "resume with" in stderr
    _, record = only_run(workdir)
    assert record.status == "stopped"
    # The workers checkpointed the step they had finished before exiting.
    assert list((workdir / "runs" / run_id / "checkpoints").glob("step-*/manifest.json"))
    assert not processes_mentioning(str(workdir)), "a worker outlived its run"


def _wait_for_step(workdir: Path, *, step: int, process: subprocess.Popen) -> str:
    deadline = time.monotonic() + 240
    database = workdir / "runs" / "rollout.db"
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        if database.exists():
            store = open_store(f"sqlite:{database}", create=False)
            runs = store.list_runs()
            if runs and (runs[0].last_step or 0) >= step:
                return runs[0].run_id
        time.sleep(0.3)
    raise AssertionError(f"the run did not reach step {step} within 240 s")


def test_two_data_parallel_ranks_train_and_checkpoint_both(workdir):
    """Two torchrun workers (gloo): each samples its share of the prompts, gradients are
    averaged, the checkpoint carries both ranks' data cursors and rank 1's RNG states, and the
    eval means are over every prompt however unevenly the ranks shared them."""
    import json

    result = rollout(
        workdir,
        "run",
        "--config",
        "examples/grpo-tiny.toml",
        "--set",
        "cluster.nproc_per_node=2",
        "--set",
        "algorithm.max_steps=2",
        "--set",
        "rewards=[{ fn = './marked.py:marked' }]",
        "--set",
        "data.eval.limit=3",
        "--set",
        "run.eval_interval=null",
        "--set",
        "run.eval_samples=3",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    store, record = only_run(workdir)
    assert record.status == "finished"
    # Eval prompts 0 and 2 on rank 0 (rewards 1 and 0), prompt 1 on rank 1 (reward 0), each
    # sampled 3 times: 3 of 9, where the mean of the ranks' means would be (1/2 + 0) / 2 (and
    # counting rows, not samples, 3 of 3).
    for name in ("eval/reward", "eval/marked"):
        evals = sorted(store.metrics(record.run_id, [name]), key=lambda m: m.step)
        assert [m.step for m in evals] == [0, 2]
        assert [m.value for m in evals] == pytest.approx([1 / 3, 1 / 3]), name
    (checkpoint,) = (workdir / "runs").glob("*/checkpoints/step-000002")
    state = json.loads((checkpoint / "trainer.json").read_text())["trainer_state"]
    assert set(state["cursor"]) == {"0", "1"}
    assert set(state["rng"]) == {"1"} and len(state["rng"]["1"]["torch"]) > 0
    # one shared shuffled order, dealt out by rank: both ranks stand at the same place in it
    assert state["cursor"]["0"]["position"] == state["cursor"]["1"]["position"] > 0
    rank1 = rollout(workdir, "logs", "tail", record.run_id, "--rank", "1")
    assert rank1.returncode == 0 and rank1.stdout.strip(), rank1.stdout + rank1.stderr
