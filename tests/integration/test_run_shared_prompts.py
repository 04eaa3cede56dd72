"""`rollout run` with two actor processes sharing each step's prompts through the work queue
(gloo on CPU, torchrun, the tiny model).

A reward plugin sleeps on one rank's calls, so that actor is slow: the fast actor claims more
chunks, and with the slow rank swapped the chunks go the other way, yet the losses are the same
bit for bit (seeds follow the chunk, batches are assembled in item order). Each run takes
20-40 s, so they are marked slow.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from rollout.storage import open_store
from tests.integration.driver import rollout

pytestmark = pytest.mark.slow

# Sleeps on the calls of the actor whose global rank is SLOW_RANK; the score never depends on it.
SLOWED_REWARD = """
import os
import time


def slowed(prompts, completions, **_):
    if os.environ.get("RANK") == os.environ.get("SLOW_RANK"):
        time.sleep(0.25)
    return [1.0 / (1 + len(c)) for c in completions]
"""

STEPS, PROMPTS = 3, 8  # 8 prompts x 4 completions a step, one prompt a chunk
SHARED = (
    "cluster.nproc_per_node=3",
    "cluster.placement={ actor = [0, 1], learner = [2] }",
    f"algorithm.max_steps={STEPS}",
    f"algorithm.rollout_batch_size={PROMPTS * 4}",
    "algorithm.minibatch_size=16",
    "cluster.queue_chunk_size=1",
    "rewards=[{ fn = './slowed.py:slowed' }]",
    "logging.level='debug'",  # the learner logs each step's prompts, in item order
)


def _run(workdir, *settings: str, slow_rank: int | None = None) -> str:
    """Run the settings; the new run's id."""
    (workdir / "examples" / "slowed.py").write_text(SLOWED_REWARD)
    before = {r.run_id for r in _store(workdir).list_runs()} if _has_store(workdir) else set()
    args = ["run", "--config", "examples/grpo-tiny.toml", "--set", "data.eval=null"]
    args += ["--set", "cluster.threads_per_process=1"]
    for setting in settings:
        args += ["--set", setting]
    os.environ["SLOW_RANK"] = str(slow_rank)
    try:
        result = rollout(workdir, *args)
    finally:
        os.environ.pop("SLOW_RANK")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    (run_id,) = {r.run_id for r in _store(workdir).list_runs()} - before
    return run_id


def _has_store(workdir) -> bool:
    return (workdir / "runs" / "rollout.db").exists()


def _store(workdir):
    return open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False)


def _series(workdir, run_id: str, name: str) -> list[float]:
    metrics = _store(workdir).metrics(run_id, [name])
    return [m.value for m in sorted(metrics, key=lambda m: m.step)]


def _prompts_by_step(workdir, run_id: str, rank: int) -> dict[int, list[str]]:
    """The prompts each step trained on, in item order, from the learner's debug log."""
    found = {}
    for line in _store(workdir).logs(run_id, level="debug", rank=rank, limit=100_000):
        if line.message.startswith("step ") and " prompts " in line.message:
            step, _, prompts = line.message.removeprefix("step ").partition(" prompts ")
            found[int(step)] = prompts.split(",")
    return found


def test_a_slowed_actor_claims_fewer_chunks_and_the_losses_do_not_change(workdir):
    slow_first = _run(workdir, *SHARED, slow_rank=0)
    slow_second = _run(workdir, *SHARED, slow_rank=1)

    claimed = {
        run: [sum(_series(workdir, run, f"queue/chunks_claimed/actor_{actor}")) for actor in (0, 1)]
        for run in (slow_first, slow_second)
    }
    for run in (slow_first, slow_second):
        assert _store(workdir).get_run(run).status == "finished"
        assert sum(claimed[run]) == STEPS * PROMPTS, claimed  # nothing redone: no lease expired
        assert _series(workdir, run, "queue/chunks_requeued") == [0.0] * STEPS
        assert all(math.isfinite(s) for s in _series(workdir, run, "queue/wait_s/actor_0"))
    # Work stealing: the slowed actor claimed fewer chunks than the fast one, both ways round.
    assert 0 < claimed[slow_first][0] < claimed[slow_first][1], claimed
    assert 0 < claimed[slow_second][1] < claimed[slow_second][0], claimed

    # Every prompt of every step trained once: 8 different prompts a step, none seen twice in
    # the run (1000 records: epoch 0 repeats none), the same in both runs.
    prompts = _prompts_by_step(workdir, slow_first, rank=2)
    assert sorted(prompts) == list(range(1, STEPS + 1))
    assert all(len(p) == PROMPTS for p in prompts.values())
    assert len({p for step in prompts.values() for p in step}) == STEPS * PROMPTS
    assert _prompts_by_step(workdir, slow_second, rank=2) == prompts

    # Which actor did which chunk changed; the batches, and so the losses, did not.
    for name in ("train/loss", "reward/mean", "reward/std", "train/grad_norm"):
        first, second = _series(workdir, slow_first, name), _series(workdir, slow_second, name)
        assert len(first) == STEPS and first == second, name


def test_two_actors_feed_two_learners_the_batch_one_learner_trains_on(workdir):
    """Each learner takes its half of every chunk-assembled batch. With one minibatch a step
    (so one and two learners take the same optimizer steps), step 1 (the same weights and seeds
    on both) trains on the same rows: the same gradient, summed in another order. Later steps
    drift apart by that rounding only."""
    one_minibatch = (*SHARED, f"algorithm.minibatch_size={PROMPTS * 4}")
    one = _run(workdir, *one_minibatch)
    two = _run(
        workdir,
        *one_minibatch,
        "cluster.nproc_per_node=4",
        "cluster.placement={ actor = [0, 1], learner = [2, 3] }",
    )
    assert _store(workdir).get_run(two).status == "finished"
    series = {
        name: (_series(workdir, one, name), _series(workdir, two, name))
        for name in ("train/loss", "train/grad_norm", "reward/mean", "reward/std")
    }
    for name, (single, split) in series.items():
        assert len(single) == len(split) == STEPS, name
        assert split == pytest.approx(single, rel=0.05), name  # rows missing would show here
    for name in ("reward/mean", "reward/std"):
        assert series[name][1][0] == series[name][0][0], name
    grad_norm_one, grad_norm_two = series["train/grad_norm"]
    assert grad_norm_two[0] == pytest.approx(grad_norm_one[0], rel=1e-4)
    assert _prompts_by_step(workdir, two, rank=3) == _prompts_by_step(workdir, one, rank=2)


def test_async_learners_checkpoint_their_shares_of_the_batch_ahead(workdir):
    """max_staleness = 1 with the work queue: before the step-2 checkpoint each learner takes
    its half of batch 3 from the queue's chunks (sampled with version 1) and the checkpoint
    saves both halves in buffer/; the run then trains step 3 on them and finishes."""
    run_id = _run(
        workdir,
        *SHARED,
        "algorithm.max_steps=4",
        "algorithm.max_staleness=1",
        "checkpoint.interval=2",
        "cluster.nproc_per_node=4",
        "cluster.placement={ actor = [0, 1], learner = [2, 3] }",
    )
    assert _store(workdir).get_run(run_id).status == "finished"
    assert _series(workdir, run_id, "train/staleness") == [0.0, 1.0, 1.0, 1.0]
    checkpoint = workdir / "runs" / run_id / "checkpoints" / "step-000002"
    shares = [json.loads((checkpoint / "buffer" / f"learner-{i}.json").read_text()) for i in (0, 1)]
    for share in shares:
        assert [(h["step"], h["header"]["policy_version"]) for h in share] == [(3, 1)]
        assert len(share[0]["header"]["completion_lengths"]) == PROMPTS * 4 // 2
    # The same step metrics on both learners (every learner gets every chunk's metrics).
    assert shares[0][0]["metrics"] == shares[1][0]["metrics"]
    verified = rollout(workdir, "checkpoints", "verify", str(checkpoint))
    assert verified.returncode == 0, verified.stdout + verified.stderr
