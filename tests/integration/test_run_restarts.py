"""A dead actor is restarted and the run goes on; a dead learner fails the run, resumably.

Each test runs GRPO on the tiny model with one actor and one learner (gloo on CPU, torchrun, the
CLI in a subprocess, as a user would), a checkpoint every step, and kills a worker with SIGKILL
part-way through, found by the pid in its activity file (workers/rank-N.json).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from rollout.executor.processes import proc_stat
from rollout.storage import open_store
from tests.integration.driver import processes_mentioning, rollout, start

pytestmark = pytest.mark.slow

STEPS = 6
SETTINGS = (
    "data.eval=null",
    "cluster.threads_per_process=1",
    "cluster.nproc_per_node=2",
    "cluster.placement={ actor = [0], learner = [1] }",
    f"algorithm.max_steps={STEPS}",
    "checkpoint.interval=1",
)
# 0.3 s a step on the actor: a step is long enough to be hit in the middle.
SLOW = "rewards=[{ fn = './slow.py:slow' }]"
# The same, and the actor starts a child that would outlive it (a plugin's helper process).
FORKING = "rewards=[{ fn = './forking.py:forking' }]"
FORKING_REWARD = """
import subprocess, sys, time

children = []

def forking(prompts, completions, **_):
    if not children:
        children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
    time.sleep(0.3)
    return [0.0 for _ in completions]
"""
ACTOR, LEARNER = 0, 1


def _start(workdir: Path, *extra: str, reward: str = SLOW):
    args = ["run", "--config", "examples/grpo-tiny.toml"]
    for setting in (*SETTINGS, reward, *extra):
        args += ["--set", setting]
    return start(workdir, *args)


def _store(workdir: Path):
    return open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False)


def _run_id(workdir: Path) -> str | None:
    runs = [p.name for p in (workdir / "runs").glob("*") if (p / "plan.lock").exists()]
    return runs[0] if runs else None


def _last_step(workdir: Path) -> int:
    run_id = _run_id(workdir)
    if run_id is None or not (workdir / "runs" / "rollout.db").exists():
        return 0
    with _store(workdir) as store:
        record = store.get_run(run_id)
        return (record.last_step or 0) if record is not None else 0


def _worker_pid(workdir: Path, rank: int) -> int | None:
    """The live pid rank `rank` wrote into its activity file, if any."""
    path = workdir / "runs" / (_run_id(workdir) or "-") / "workers" / f"rank-{rank}.json"
    try:
        pid = json.loads(path.read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None
    fields = proc_stat(pid)
    return pid if fields is not None and fields[0] not in ("Z", "X") else None


def _wait(condition, *, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout} s")


def _kill_at_step(workdir: Path, rank: int, step: int) -> int:
    """SIGKILL rank `rank`'s worker once the run has recorded step `step`; its pid."""
    _wait(lambda: _last_step(workdir) >= step, timeout=180, what=f"step {step} recorded")
    pid = _wait(lambda: _worker_pid(workdir, rank), timeout=30, what=f"rank {rank}'s pid")
    os.kill(pid, signal.SIGKILL)
    return pid


def _nothing_left(workdir: Path) -> None:
    _wait(
        lambda: not processes_mentioning(str(workdir)),
        timeout=10,
        what="every process of the run ending",
    )


def _gone(pid: int) -> bool:
    fields = proc_stat(pid)
    return fields is None or fields[0] in ("Z", "X")


def _restarts(workdir: Path) -> float:
    run_id = _run_id(workdir)
    with _store(workdir) as store:
        found = store.latest_metrics(run_id).get("run/restarts")
        return found.value if found is not None else 0.0


def _steps(store, run_id: str, name: str) -> list[int]:
    return sorted(m.step for m in store.metrics(run_id, [name]))


def _children_of_plugins(workdir: Path) -> set[int]:
    """The forking reward's children: their environment carries the run's token, their command
    line nothing of the run, so they are found as children of the actor."""
    pid = _worker_pid(workdir, ACTOR)
    children = Path(f"/proc/{pid}/task/{pid}/children")
    with contextlib.suppress(OSError, TypeError):
        return {int(child) for child in children.read_text().split()}
    return set()


def test_a_killed_actor_is_restarted_and_the_run_finishes_with_every_step(workdir):
    (workdir / "examples" / "forking.py").write_text(FORKING_REWARD)
    host = _start(workdir, reward=FORKING)
    _wait(lambda: _last_step(workdir) >= 2, timeout=180, what="step 2 recorded")
    orphans = _wait(lambda: _children_of_plugins(workdir), timeout=30, what="the plugin's child")
    killed = _kill_at_step(workdir, ACTOR, 2)
    # The dead attempt's leftovers are killed before the next starts, not at the run's end.
    _wait(lambda: _restarts(workdir), timeout=120, what="the restart recorded")
    _wait(lambda: all(_gone(pid) for pid in orphans), timeout=10, what="the plugin's child ending")
    out, err = host.communicate(timeout=300)
    assert host.returncode == 0, out + err
    assert "restarting" in out and "rank 0 (actor+reward) died from signal SIGKILL" in out, out
    _nothing_left(workdir)
    assert _gone(killed)
    with _store(workdir) as store:
        (record,) = store.list_runs()
        assert record.status == "finished" and record.last_step == STEPS
        # Every step once, the steps redone after the restart included (one row per step).
        for name in ("train/loss", "reward/mean"):
            assert _steps(store, record.run_id, name) == list(range(1, STEPS + 1)), name
        (restarts,) = store.metrics(record.run_id, ["run/restarts"])
        assert restarts.value == 1.0 and 2 <= restarts.step < STEPS
        warnings = [
            log for log in store.logs(record.run_id, level="warning") if "restarting" in log.message
        ]
        assert len(warnings) == 1 and warnings[0].rank == ACTOR and warnings[0].role
        assert "restart 1 of cluster.max_restarts = 3" in warnings[0].message


def test_a_killed_learner_fails_the_run_at_once_and_the_plan_resumes(workdir):
    host = _start(workdir)
    _kill_at_step(workdir, LEARNER, 2)
    killed_at = time.monotonic()
    out, err = host.communicate(timeout=120)
    took = time.monotonic() - killed_at
    assert host.returncode == 1, out + err
    assert "restarting" not in out
    assert "rank 1 (learner) died from signal SIGKILL" in err, err
    assert "not restarted" in err and "rollout run --plan" in err, err
    assert took < 30, f"the run took {took:.1f} s to fail after its learner died"
    _nothing_left(workdir)
    run_id = _run_id(workdir)
    with _store(workdir) as store:
        record = store.get_run(run_id)
        assert record.status == "failed" and "rank 1 (learner)" in record.error
        assert not store.metrics(run_id, ["run/restarts"])
        done = record.last_step
    # Run the plan again: it resumes from the newest checkpoint and finishes.
    resumed = rollout(workdir, "run", "--plan", str(workdir / "runs" / run_id / "plan.lock"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming" in resumed.stdout
    with _store(workdir) as store:
        record = store.get_run(run_id)
        assert record.status == "finished" and record.last_step == STEPS > done
        assert _steps(store, run_id, "train/loss") == list(range(1, STEPS + 1))
    _nothing_left(workdir)


def test_with_no_restarts_allowed_a_killed_actor_fails_the_run(workdir):
    host = _start(workdir, "cluster.max_restarts=0")
    _kill_at_step(workdir, ACTOR, 1)
    out, err = host.communicate(timeout=120)
    assert host.returncode == 1, out + err
    assert "restarting" not in out
    assert "rank 0 (actor+reward) died from signal SIGKILL" in err, err
    assert "cluster.max_restarts = 0 allows no restart" in err, err
    _nothing_left(workdir)
