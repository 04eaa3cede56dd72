"""GRPO with the learners sharded (cluster.sharding = "fsdp") and the actor on a process of its
own, through the real CLI and torchrun (gloo on CPU, one actor and two learners): the sharded run
trains as the unsharded run of the same placement does, and a stopped sharded run resumes from
its gathered checkpoint. Each run takes 15-30 s here, so they are marked slow."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from rollout.storage import open_store
from tests.integration.driver import COUNTING_REWARD, plan_with, rollout

pytestmark = pytest.mark.slow

SPLIT = (
    "data.eval=null",
    "cluster.threads_per_process=1",  # the same summation order on both sides
    "cluster.nproc_per_node=3",
    "cluster.placement={ actor = [0], learner = [1, 2] }",
    "algorithm.kl_coef=0.05",  # a reference model in play: each learner keeps a whole copy
)

# float32 everywhere; FSDP reduce-scatters gradients where the replicated run all-reduces them,
# and the sharded learner takes the plain forward where the replicated one runs a shared
# prompt once: the sums differ in their last bits, and three steps carry that forward.
TOLERANCE = 1e-4


def _run(directory: Path, *settings: str) -> tuple[str, dict[str, list[float]]]:
    args = ["run", "--config", "examples/grpo-tiny.toml"]
    for setting in (*SPLIT, *settings):
        args += ["--set", setting]
    result = rollout(directory, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    with open_store(f"sqlite:{directory / 'runs' / 'rollout.db'}", create=False) as store:
        (record,) = store.list_runs()
        assert record.status == "finished"
        metrics: dict[str, list[float]] = {}
        for metric in sorted(store.metrics(record.run_id), key=lambda m: m.step):
            metrics.setdefault(metric.name, []).append(metric.value)
    return record.run_id, metrics


def test_sharded_learners_train_as_the_unsharded_split(workdir):
    sharded_dir, plain_dir = workdir / "sharded", workdir / "plain"
    for here in (sharded_dir, plain_dir):
        shutil.copytree(workdir / "examples", here / "examples")
    _, sharded = _run(sharded_dir, "algorithm.max_steps=3", "cluster.sharding=fsdp")
    _, plain = _run(plain_dir, "algorithm.max_steps=3")
    for name in ("train/loss", "reward/mean", "train/grad_norm", "train/kl"):
        assert len(sharded[name]) == 3, name
        for ours, theirs in zip(sharded[name], plain[name], strict=True):
            assert math.isclose(ours, theirs, rel_tol=TOLERANCE, abs_tol=TOLERANCE), (
                name,
                sharded[name],
                plain[name],
            )
    # Steps 2 and 3 sampled with the weights synced after steps 1 and 2: equal rewards say the
    # actor took the gathered policy (the checksum test is tests/unit/test_sharded_sync.py).
    assert sharded["train/loss"] != [0.0, 0.0, 0.0]
    assert all(s > 0 for s in sharded["perf/weight_sync_s"])


def test_a_stopped_sharded_split_run_resumes_from_its_gathered_checkpoint(workdir):
    """The actor's reward fails on step 3's call: the run stops after the step-2 checkpoint;
    the same plan run again resumes there (every learner reads it, keeps its shards) and
    finishes."""
    (workdir / "examples" / "counting.py").write_text(COUNTING_REWARD)
    settings = (
        *SPLIT,
        "cluster.sharding=fsdp",
        "algorithm.max_steps=4",
        "checkpoint.interval=2",
        "rewards=[{ fn = './counting.py:counting' }]",
    )
    plan = plan_with(workdir, "examples/grpo-tiny.toml", *settings)
    env = {"FAIL_AFTER": "2", "COUNT_FILE": str(workdir / "count")}
    failed = rollout(workdir, "run", "--plan", str(plan), env=env)
    assert failed.returncode != 0
    store = open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False)
    (record,) = store.list_runs()
    assert [c.step for c in store.checkpoints(record.run_id)] == [2]

    resumed = rollout(workdir, "run", "--plan", str(plan))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    (record,) = store.list_runs()
    assert record.status == "finished" and record.last_step == 4
    assert [c.step for c in store.checkpoints(record.run_id)] == [2, 4]
    logs = rollout(workdir, "logs", "tail", record.run_id, "--rank", "0")
    assert "actor 0 generating steps 3..4" in logs.stdout, logs.stdout
    losses = [m.value for m in store.metrics(record.run_id, ["train/loss"])]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
