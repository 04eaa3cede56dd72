"""Multi-turn episodes with actors and learners on processes of their own (gloo on CPU,
torchrun): guess_number on the tiny model, one actor and one learner, against the colocated run
of the same plan; the tools environment with its calculator; a plugin environment that keeps an
episodic memory, stopped and resumed. They take 30-90 s each, so they are marked slow."""

from __future__ import annotations

import json
import math

import pytest

from rollout.storage import open_store
from tests.integration.driver import only_run, processes_mentioning, rollout
from tests.integration.test_run_environments import REMEMBERING

pytestmark = pytest.mark.slow

SPLIT = ("cluster.nproc_per_node=2", "cluster.placement={ actor = [0], learner = [1] }")
GUESS = (
    'model={ builtin = "tiny-llama" }',
    "data.system_prompt=null",
    'data.eval={ path = "data/guess-eval.jsonl", limit = 4 }',
    "run.eval_interval=2",
    "algorithm.max_steps=3",
    "algorithm.rollout_batch_size=8",
    "algorithm.num_generations=4",
    "algorithm.minibatch_size=8",
    "logging.samples_per_step=2",
    # One thread per process on both sides: the colocated run then sums in the same order.
    "cluster.threads_per_process=1",
)
CLOSING_GAME = """
from pathlib import Path

from rollout.harness.environments.base import StepResult


class ClosingGame:
    def reset(self, rows, *, seed):
        return [str(row["prompt"]) for row in rows]

    def step(self, episodes, actions):
        return [StepResult("Again.", reward=len(a) / 100) for a in actions]

    def close(self):
        Path("closed-by-the-run").write_text("closed")
"""
STOPPING_GAME = """
import os

from rollout.harness.environments.guess_number import GuessNumber


class StopsOnce(GuessNumber):
    \"\"\"guess_number that fails the run once, as the fourth training batch starts.\"\"\"

    resets = 0

    def reset(self, rows, *, seed):
        if len(rows) > 4:  # a training batch (the held-out ones have 4 rows)
            StopsOnce.resets += 1
            if StopsOnce.resets == 4 and not os.path.exists("stopped-once"):
                open("stopped-once", "w").close()
                raise RuntimeError("stopping once")
        return super().reset(rows, seed=seed)
"""
EVAL = ("eval/reward", "eval/solved_fraction", "eval/turns_mean")
EPISODE_METRICS = ("episode/turns_mean", "episode/solved_fraction", "episode/tokens_mean")


def _run(workdir, config: str, *settings: str, timeout: float = 300):
    args = ["run", "--config", config]
    for setting in settings:
        args += ["--set", setting]
    result = rollout(workdir, *args, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    return result


def _runs(workdir):
    store = open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False)
    return store, sorted(store.list_runs(), key=lambda r: r.run_id)


def _series(store, run_id: str, name: str) -> list[float]:
    return [m.value for m in sorted(store.metrics(run_id, [name]), key=lambda m: m.step)]


@pytest.mark.parametrize(
    ("kind", "advantage", "eval_samples"),
    [("grpo", "episode", 1), ("grpo", "turn", 2), ("reinforce_pp", "turn", 1)],
    ids=["grpo-episode", "grpo-turn", "reinforce_pp-turn"],
)
def test_guess_number_split_matches_the_colocated_run(workdir, kind, advantage, eval_samples):
    """max_staleness = 0: the actor plays the games colocated rank 0 plays, with its seeds and
    weights, so the learner (given the episodes' loss mask, and per-turn advantages, or per-turn
    rewards it scores per token) computes the colocated numbers: had the environment's tokens
    entered its loss, train/loss would differ. The actor plays the held-out episodes too
    (greedy, or run.eval_samples sampled)."""
    settings = (
        *GUESS,
        f"algorithm.kind={kind}",
        f"environment.advantage={advantage}",
        f"run.eval_samples={eval_samples}",
    )
    _run(workdir, "examples/guess-number.toml", *settings)
    _run(workdir, "examples/guess-number.toml", *settings, *SPLIT)
    store, (colocated, split) = _runs(workdir)
    for record in (colocated, split):
        assert record.status == "finished" and record.last_step == 3
    for name in ("train/loss", "reward/mean", "train/grad_norm", *EPISODE_METRICS, *EVAL):
        assert _series(store, split.run_id, name) == _series(store, colocated.run_id, name), name
    evaluated = sorted(m.step for m in store.metrics(split.run_id, ["eval/reward"]))
    assert evaluated == [0, 2, 3]
    # Episodes had environment tokens (more tokens than the model's own answers).
    tokens = _series(store, split.run_id, "episode/tokens_mean")
    answers = _series(store, split.run_id, "completion/tokens_mean")
    turns = _series(store, split.run_id, "episode/turns_mean")
    assert any(t > a * n for t, a, n in zip(tokens, answers, turns, strict=True))
    # The learner records the actor's samples: each an episode's turns.
    samples = store.samples(split.run_id)
    assert [(s.step, s.index) for s in samples] == [(s, i) for s in (1, 2, 3) for i in (0, 1)]
    for sample in samples:
        assert sample.completion is None and sample.prompt.startswith("Guess my number")
        assert sample.turns[0]["role"] == "assistant"
        assert sample.reward == sum(sample.extra["turn_rewards"])
    assert [s.turns for s in samples] == [s.turns for s in store.samples(colocated.run_id)]


def test_an_asynchronous_split_run_evaluates_each_due_version_and_resumes(workdir):
    """max_staleness = 1: the actor loads version v only to sample batch v + 2, and evaluates it
    then; the learner takes the evaluations in that order, also those a checkpoint's batches
    received ahead bring. Stopped after the step-2 checkpoint (by the environment failing at
    step 3's episodes), the resumed run finishes and every due version has its evaluation."""
    (workdir / "examples" / "stops.py").write_text(STOPPING_GAME)
    settings = [
        *GUESS,
        "algorithm.max_steps=4",
        "algorithm.max_staleness=1",
        "checkpoint.interval=2",
        "environment.name='./stops.py:StopsOnce'",
        "environment.options={}",
        "cluster.max_restarts=0",
        *SPLIT,
    ]
    args = ["plan", "--config", "examples/guess-number.toml", "-o", "async.lock"]
    for setting in settings:
        args += ["--set", setting]
    planned = rollout(workdir, *args)
    assert planned.returncode == 0, planned.stderr
    first = rollout(workdir, "run", "--plan", "async.lock")
    assert first.returncode != 0 and "stopping once" in first.stdout + first.stderr
    resumed = rollout(workdir, "run", "--plan", "async.lock")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    store, (record,) = _runs(workdir)
    assert record.status == "finished" and record.last_step == 4
    assert [c.step for c in store.checkpoints(record.run_id)] == [2, 4]
    assert _series(store, record.run_id, "train/staleness") == [0.0, 1.0, 1.0, 1.0]
    evaluated = sorted(m.step for m in store.metrics(record.run_id, ["eval/reward"]))
    assert evaluated == [0, 2, 4]
    for name in (*EVAL, *EPISODE_METRICS):
        assert all(math.isfinite(v) for v in _series(store, record.run_id, name)), name


def test_the_tools_environment_runs_split(workdir):
    _run(
        workdir,
        "examples/tools-tiny.toml",
        "algorithm.max_steps=2",
        "environment.max_turns=2",
        "cluster.threads_per_process=1",
        *SPLIT,
        timeout=600,
    )
    store, (record,) = _runs(workdir)
    assert record.status == "finished" and record.last_step == 2
    for name in ("episode/tool_calls_mean", "episode/turns_mean", "train/loss"):
        values = _series(store, record.run_id, name)
        assert len(values) == 2 and all(math.isfinite(v) for v in values), name


def test_an_actors_memory_is_checkpointed_by_the_learner_and_restored_on_resume(workdir):
    """The environment (and its memory) lives in the actor's process; the learner writes the
    checkpoints. The actor fails at step 3; resumed from the step-2 checkpoint, the actor finds
    the memory of steps 1 and 2 again (the learner sent it back with its weights)."""
    (workdir / "examples" / "remember.py").write_text(REMEMBERING)
    args = ["plan", "--config", "examples/grpo-tiny.toml", "-o", "memory.lock"]
    for setting in (
        "rewards=[]",
        "environment.name='./remember.py:Remembers'",
        "environment.max_turns=2",
        "data.eval=null",
        "algorithm.max_steps=4",
        "checkpoint.interval=2",
        "cluster.max_restarts=0",  # the actor's failure ends the run (test_run_restarts)
        *SPLIT,
    ):
        args += ["--set", setting]
    planned = rollout(workdir, *args)
    assert planned.returncode == 0, planned.stderr
    first = rollout(workdir, "run", "--plan", "memory.lock")
    assert first.returncode != 0 and "stopping once" in first.stdout + first.stderr
    resumed = rollout(workdir, "run", "--plan", "memory.lock")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    seen = (workdir / "seen.log").read_text().split("\n")
    assert seen[:-1] == ["1 0", "2 1", "3 2", "3 2", "4 3"]
    _, record = only_run(workdir)
    assert record.status == "finished" and record.last_step == 4
    shown = rollout(workdir, "memory", "show", record.run_id, "player", "--format", "json")
    assert shown.returncode == 0, shown.stderr
    entries = json.loads(shown.stdout)["entries"]
    assert [(e["step"], e["text"]) for e in entries] == [
        (step, f"played step {step}") for step in (1, 2, 3, 4)
    ]


def test_a_sidecar_environment_starts_and_stops_with_the_actors_process(workdir):
    """The sidecar runs beside the actor, which plays the episodes; as the actor's process ends
    it closes the environment (its close() runs in the sidecar) and the sidecar stops."""
    (workdir / "examples" / "games.py").write_text(CLOSING_GAME)
    _run(
        workdir,
        "examples/grpo-tiny.toml",
        "rewards=[]",
        "environment.name='./games.py:ClosingGame'",
        "environment.isolation='sidecar'",
        "environment.max_turns=2",
        "environment.max_observation_tokens=24",
        "data.eval=null",
        "algorithm.max_steps=2",
        "cluster.threads_per_process=1",
        *SPLIT,
    )
    store, record = only_run(workdir)
    assert record.status == "finished" and record.last_step == 2
    assert _series(store, record.run_id, "episode/turns_mean") == [2.0, 2.0]
    assert (workdir / "closed-by-the-run").read_text() == "closed"
    sidecars = set(processes_mentioning("rollout.plugins.sidecar.server"))
    assert not sidecars & set(processes_mentioning(str(workdir)))
