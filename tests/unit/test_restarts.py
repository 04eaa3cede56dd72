"""Restarts: cluster.max_restarts resolved and refused at plan time, which rank ended an attempt,
and what the host records and says when it restarts or fails the run."""

from __future__ import annotations

import json
import os

import pytest

from rollout import PlanError
from rollout.executor.failure import activity_file, error_file, first_death
from rollout.executor.restarts import RESTARTS_METRIC, Restarts
from rollout.planner.builder import build_plan
from rollout.planner.definition import HardwareFacts
from rollout.storage import open_store

LAPTOP = HardwareFacts(
    platform="test", cpu_count=8, memory_bytes=2**34, memory_available_bytes=2**33
)
SPLIT = {"nproc_per_node": 2, "placement": {"actor": [0], "learner": [1]}}

# torchrun's failure summary: the root cause (the first failure it saw) comes last.
SUMMARY = """
Failures:
[1]:
  time      : 2026-01-01_00:00:01
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 11)
  error_file: <N/A>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_00:00:01
  host      : box
  rank      : 0 (local_rank: 0)
  exitcode  : -9 (pid: 10)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 10
"""


def _plan(config_file, base_config, **cluster):
    base_config["cluster"].update(cluster)
    return build_plan(config_file(base_config), hardware=LAPTOP)


def test_restarts_default_to_three_with_actor_ranks_and_to_none_colocated(config_file, base_config):
    assert _plan(config_file, base_config).derived.max_restarts == 0
    assert _plan(config_file, base_config, **SPLIT).derived.max_restarts == 3
    assert _plan(config_file, base_config, **SPLIT, max_restarts=0).derived.max_restarts == 0


def test_restarts_on_a_colocated_run_are_refused_with_a_hint(config_file, base_config):
    base_config["cluster"]["max_restarts"] = 2
    with pytest.raises(PlanError) as caught:
        build_plan(config_file(base_config), hardware=LAPTOP)
    (issue,) = [i for i in caught.value.issues if i.path == "cluster.max_restarts"]
    assert "every rank of this run holds learner state" in issue.message
    assert "max_restarts = 0" in issue.hint and "placement" in issue.hint


def _write_activity(run_dir, rank, step, inside=None):
    activity_file(run_dir, rank).parent.mkdir(parents=True, exist_ok=True)
    activity_file(run_dir, rank).write_text(json.dumps({"pid": 1, "step": step, "inside": inside}))


def test_a_rank_killed_by_a_signal_is_the_cause_not_the_peer_that_raised(tmp_path):
    # The learner raised when its actor's connection closed; the actor died without a word.
    error_file(tmp_path, 1).parent.mkdir(parents=True)
    error_file(tmp_path, 1).write_text("RuntimeError: Connection closed by peer\n")
    _write_activity(tmp_path, 0, 4, "reward 'slow'")
    death = first_death(tmp_path, SUMMARY)
    assert (death.rank, death.exitcode, death.traceback, death.step) == (0, -9, None, 4)
    assert death.how() == "from signal SIGKILL (exit code -9)"
    assert death.where() == " at step 4 inside reward 'slow'"


def test_a_rank_that_timed_out_in_a_collective_is_the_cause_not_the_stuck_rank_killed(tmp_path):
    # Rank 0 stalled inside a plugin; rank 1 waited past the collective timeout and raised;
    # torchrun then killed the stuck rank 0 with SIGKILL once it ignored SIGTERM.
    error_file(tmp_path, 1).parent.mkdir(parents=True)
    error_file(tmp_path, 1).write_text(
        "RuntimeError: [gloo] Timed out waiting 4000ms for recv operation to complete\n"
    )
    death = first_death(tmp_path, SUMMARY)
    assert death.rank == 1 and death.traceback == error_file(tmp_path, 1)


def test_a_rank_torchrun_stopped_with_sigterm_is_never_the_cause(tmp_path):
    # The learner raised (out of memory, say); torchrun then stopped the actor with SIGTERM.
    error_file(tmp_path, 1).parent.mkdir(parents=True)
    error_file(tmp_path, 1).write_text("torch.OutOfMemoryError: ...\n")
    summary = SUMMARY.replace("exitcode  : -9", "exitcode  : -15")
    death = first_death(tmp_path, summary)
    assert death.rank == 1 and death.traceback == error_file(tmp_path, 1)
    (tmp_path / "errors" / "rank-1.txt").unlink()
    only_sigterms = summary.replace("exitcode  : 1", "exitcode  : -15")
    assert first_death(tmp_path, only_sigterms).rank == 0  # torchrun's root cause


def test_when_every_failed_rank_raised_the_first_traceback_is_the_cause(tmp_path):
    for rank, when in ((1, 100), (0, 200)):
        error_file(tmp_path, rank).parent.mkdir(parents=True, exist_ok=True)
        error_file(tmp_path, rank).write_text(f"ValueError: {rank}\n")
        os.utime(error_file(tmp_path, rank), (when, when))
    summary = SUMMARY.replace("exitcode  : -9", "exitcode  : 1")
    death = first_death(tmp_path, summary)
    assert death.rank == 1 and death.traceback == error_file(tmp_path, 1)
    assert death.how() == "raising an exception"
    assert first_death(tmp_path / "nothing", "torchrun crashed") is None


def test_an_actor_death_is_restarted_and_recorded_until_the_budget_is_spent(
    tmp_path, config_file, base_config
):
    plan = _plan(config_file, base_config, **SPLIT, max_restarts=1)
    _write_activity(tmp_path, 0, 2)
    with open_store(f"sqlite:{tmp_path / 'rollout.db'}") as store:
        store.create_run(plan.run_id, name="r", plan_sha256="0" * 64, plan_path="p", run_dir="d")
        restarts = Restarts.of(plan, 0, store)
        death = first_death(tmp_path, SUMMARY)
        assert restarts.allows(death)
        line = restarts.record(store, death, "rank 0 died")
        assert line.startswith("rank 0 (actor+reward) died from signal SIGKILL (exit code -9)")
        assert "restart 1 of cluster.max_restarts = 1" in line
        (log,) = store.logs(plan.run_id, level="warning")
        assert (log.rank, log.role, log.message) == (0, "actor+reward", line)
        assert store.latest_metrics(plan.run_id)[RESTARTS_METRIC].value == 1.0
        assert not restarts.allows(death)  # spent
        message = restarts.failure(death, "the cause", "plan.lock", store)
        assert "restarted 1 time(s) already, all that cluster.max_restarts = 1 allows" in message
        assert "`rollout run --plan plan.lock` again resumes it from its first step" in message
        assert message.endswith("\nthe cause")
        # A later start of the run counts on from the restarts recorded before it.
        assert Restarts.of(plan, 0, store).earlier == 1
        # A joining node never restarts.
        assert Restarts.of(plan, 1, store).budget == 0


def test_a_learner_death_is_never_restarted(tmp_path, config_file, base_config):
    plan = _plan(config_file, base_config, **SPLIT)
    _write_activity(tmp_path, 1, 3)
    summary = "Root Cause (first observed failure):\n  rank      : 1 (local_rank: 1)\n"
    summary += "  exitcode  : -9 (pid: 11)\n"
    with open_store(f"sqlite:{tmp_path / 'rollout.db'}") as store:
        restarts = Restarts.of(plan, 0, store)
        death = first_death(tmp_path, summary)
        assert death.rank == 1 and not restarts.allows(death)
        message = restarts.failure(death, "cause", "plan.lock", store)
        assert message.startswith("rank 1 (learner) died from signal SIGKILL (exit code -9) at ")
        assert "holds learner state" in message and "not restarted" in message
