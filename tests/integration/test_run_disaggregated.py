"""`rollout run` with actors and learners on processes of their own (gloo on CPU, torchrun).

Each test runs the tiny model through the CLI: a world of 2 (one actor, one learner) and of 3 (one
actor, two learners), the synchronous split against the colocated plan, an asynchronous run, and
resumes (an asynchronous one against the same run uninterrupted). They take 15-90 s each, so
they are marked slow.
"""

from __future__ import annotations

import json
import math

import pytest

from rollout.storage import open_store
from tests.integration.driver import COUNTING_REWARD, plan_with, rollout

pytestmark = pytest.mark.slow

SPLIT = ("cluster.nproc_per_node=2", "cluster.placement={ actor = [0], learner = [1] }")


def _run(workdir, *settings: str, env: dict[str, str] | None = None, check: bool = True):
    args = ["run", "--config", "examples/grpo-tiny.toml", "--set", "data.eval=null"]
    # One thread per process on both sides: the colocated run then sums in the same order.
    args += ["--set", "cluster.threads_per_process=1"]
    for setting in settings:
        args += ["--set", setting]
    result = rollout(workdir, *args, env=env)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
        assert "Traceback" not in result.stdout + result.stderr
    return result


def _runs(workdir):
    store = open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False)
    return store, sorted(store.list_runs(), key=lambda r: r.run_id)


def _series(store, run_id: str, name: str) -> list[float]:
    return [m.value for m in sorted(store.metrics(run_id, [name]), key=lambda m: m.step)]


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_one_actor_one_learner_matches_the_colocated_run(workdir, kind):
    """k = 0: the same seeds, prompts and weights as one colocated process, so the same numbers."""
    _run(workdir, "algorithm.max_steps=3", f"algorithm.kind={kind}")
    _run(workdir, "algorithm.max_steps=3", f"algorithm.kind={kind}", *SPLIT)
    store, (colocated, split) = _runs(workdir)
    for record in (colocated, split):
        assert record.status == "finished" and record.last_step == 3
    for name in ("train/loss", "reward/mean", "train/grad_norm"):
        assert _series(store, split.run_id, name) == _series(store, colocated.run_id, name), name
    assert _series(store, split.run_id, "train/staleness") == [0.0, 0.0, 0.0]
    assert all(s > 0 for s in _series(store, split.run_id, "perf/weight_sync_s"))
    # The learner checkpoints; the actor saves nothing.
    (checkpoint,) = (workdir / "runs").glob(f"{split.run_id}/checkpoints/step-000003")
    assert (checkpoint / "model" / "model.safetensors").is_file()


def test_one_actor_two_learners_train_to_the_end(workdir):
    _run(
        workdir,
        "algorithm.max_steps=3",
        "cluster.nproc_per_node=3",
        "cluster.placement={ actor = [0], learner = [1, 2] }",
    )
    store, (record,) = _runs(workdir)
    assert record.status == "finished" and record.last_step == 3
    assert len(_series(store, record.run_id, "train/loss")) == 3
    (checkpoint,) = (workdir / "runs").glob("*/checkpoints/step-000003")
    state = json.loads((checkpoint / "trainer.json").read_text())["trainer_state"]
    assert set(state["rng"]) == {"1"}  # the second learner's RNG states, by learner index


@pytest.mark.parametrize(
    ("mode", "metric"),
    [("tis", "train/stale_truncated_fraction"), ("drop", "train/stale_dropped_fraction")],
)
def test_async_one_step_stale_runs_and_records_its_staleness(workdir, mode, metric):
    _run(
        workdir,
        "algorithm.max_steps=4",
        "algorithm.max_staleness=1",
        f'algorithm.stale_samples="{mode}"',
        *SPLIT,
    )
    store, (record,) = _runs(workdir)
    assert record.status == "finished" and record.last_step == 4
    # Batch s is sampled by version s - 2: batch 1 by the starting weights, then one behind.
    assert _series(store, record.run_id, "train/staleness") == [0.0, 1.0, 1.0, 1.0]
    for name in ("train/loss", "reward/mean", "train/stale_weight_mean", metric):
        values = _series(store, record.run_id, name)
        assert values and all(math.isfinite(v) for v in values), name


def test_a_stopped_split_run_resumes_from_the_learners_checkpoint(workdir):
    """The actor's reward fails on step 3's call: the run stops after the step-2 checkpoint;
    the same plan run again resumes there and finishes."""
    (workdir / "examples" / "counting.py").write_text(COUNTING_REWARD)
    settings = (
        "algorithm.max_steps=4",
        "checkpoint.interval=2",
        "rewards=[{ fn = './counting.py:counting' }]",
        # The actor's failure ends the run rather than restarting it (test_run_restarts).
        "cluster.max_restarts=0",
        *SPLIT,
    )
    plan = plan_with(workdir, "examples/grpo-tiny.toml", "data.eval=null", *settings)
    env = {"FAIL_AFTER": "2", "COUNT_FILE": str(workdir / "count")}
    failed = rollout(workdir, "run", "--plan", str(plan), env=env)
    assert failed.returncode != 0
    store, (record,) = _runs(workdir)
    assert [c.step for c in store.checkpoints(record.run_id)] == [2]

    resumed = rollout(workdir, "run", "--plan", str(plan))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    store, (record,) = _runs(workdir)
    assert record.status == "finished" and record.last_step == 4
    assert [c.step for c in store.checkpoints(record.run_id)] == [2, 4]
    logs = rollout(workdir, "logs", "tail", record.run_id, "--rank", "0")
    assert "actor 0 generating steps 3..4" in logs.stdout, logs.stdout


# Each online kind 1 + 1, on its own tiny example: the learner's extra modules (PPO's critic, the
# reference) stay on the learner; only the policy's tensors go to the actor.
KINDS = {
    "rloo": ("examples/grpo-tiny.toml", ("algorithm.kind=rloo", "data.eval=null")),
    "reinforce_pp": ("examples/reinforce-pp-tiny.toml", ()),
    "ppo-value_head": ("examples/ppo-tiny.toml", ("algorithm.critic=value_head",)),
    "ppo-separate": ("examples/ppo-tiny.toml", ("algorithm.critic=separate",)),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_online_kind_trains_split_to_the_end(workdir, kind):
    config, settings = KINDS[kind]
    args = ["run", "--config", config, "--set", "cluster.threads_per_process=1"]
    for setting in ("algorithm.max_steps=3", *settings, *SPLIT):
        args += ["--set", setting]
    result = rollout(workdir, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    store, (record,) = _runs(workdir)
    assert record.status == "finished" and record.last_step == 3
    losses = _series(store, record.run_id, "train/loss")
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses), losses
    assert all(s > 0 for s in _series(store, record.run_id, "perf/weight_sync_s"))


def test_a_resumed_async_run_trains_on_the_batches_an_uninterrupted_one_does(workdir):
    """max_staleness = 1: batch 3 is sampled with version 1 before the step-2 checkpoint, which
    saves it (buffer/); the actor fails on step 4's reward once that checkpoint is committed.
    Resumed, the learner trains step 3 on the saved batch and the actor samples step 4 with
    version 2: every number equals the same plan's run that never stopped."""
    (workdir / "examples" / "counting.py").write_text(COUNTING_REWARD)
    settings = (
        "algorithm.max_steps=4",
        "algorithm.max_staleness=1",
        "checkpoint.interval=2",
        "rewards=[{ fn = './counting.py:counting' }]",
        "cluster.max_restarts=0",
        *SPLIT,
    )
    plan = plan_with(
        workdir, "examples/grpo-tiny.toml", "data.eval=null", "cluster.threads_per_process=1",
        *settings,
    )  # fmt: skip
    checkpoint_glob = str(workdir / "runs" / "*" / "checkpoints" / "step-000002")
    env = {
        "FAIL_AFTER": "3",
        "COUNT_FILE": str(workdir / "count"),
        "WAIT_FOR": checkpoint_glob + "/manifest.json",
    }
    failed = rollout(workdir, "run", "--plan", str(plan), env=env)
    assert failed.returncode != 0
    assert "stopped on purpose after 3 calls" in failed.stdout + failed.stderr
    (checkpoint,) = (workdir / "runs").glob("*/checkpoints/step-*")
    assert checkpoint.name == "step-000002"
    headers = json.loads((checkpoint / "buffer" / "learner-0.json").read_text())
    # Batch 3, sampled with version 1 (one step stale), is what the checkpoint holds ahead.
    assert [(h["step"], h["header"]["policy_version"]) for h in headers] == [(3, 1)]
    assert (checkpoint / "buffer" / "learner-0.safetensors").is_file()
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert {"buffer/learner-0.json", "buffer/learner-0.safetensors"} <= set(manifest["files"])
    verified = rollout(workdir, "checkpoints", "verify", str(checkpoint))
    assert verified.returncode == 0, verified.stdout + verified.stderr

    resumed = rollout(workdir, "run", "--plan", str(plan))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    _run(workdir, *settings)  # the same config, never stopped
    store, (first, second) = _runs(workdir)
    stopped, whole = (first, second) if first.run_id == _plan_run_id(plan) else (second, first)
    for record in (stopped, whole):
        assert record.status == "finished" and record.last_step == 4
    logs = rollout(workdir, "logs", "tail", stopped.run_id, "--rank", "0")
    # The actor skips step 3 (the learner holds its batch) and samples on from step 4.
    assert "actor 0 generating steps 4..4" in logs.stdout, logs.stdout
    assert _series(store, whole.run_id, "train/staleness") == [0.0, 1.0, 1.0, 1.0]
    names = ("train/loss", "reward/mean", "train/grad_norm", "train/stale_weight_mean")
    for name in names:
        series = _series(store, stopped.run_id, name)
        assert series == _series(store, whole.run_id, name), name
        assert len(series) == (4 if name != "train/stale_weight_mean" else 3), name
    # The step-4 checkpoint has nothing ahead of it: the run ends there.
    assert not (checkpoint.parent / "step-000004" / "buffer").exists()


def _plan_run_id(plan) -> str:
    return json.loads(plan.read_text())["plan"]["run_id"]
