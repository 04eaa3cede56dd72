"""`rollout run --plan plan.lock --node-rank K` for K > 0: a node that joins a run node 0 owns.

Node 0 owns the run (rollout.executor.launch): it creates the run's record, holds its lease, and
decides its final status. A joining node records nothing of the run's own: it verifies the same
plan.lock, takes a lock of its own in the run directory (`node-K.lock`: one start of node K per
machine), starts its torchrun agent as node K of the rendezvous, with the same reaper and
parent-death machinery as node 0 (no process of the run outlives this host), and watches the run
store: a cancel, or the run ended by node 0, stops its workers. Its workers write their logs and
metrics into the run store as node 0's do. When its torchrun has ended it waits, briefly, for
node 0's verdict and exits with the run's outcome.

On a SQLite run store (a file on node 0's machine) a joining node never opens it: its workers
forward their records to node 0 (rollout.runtime.forwarding), and its host learns that node 0
stopped the run from node 0's board at the rendezvous endpoint (rollout.executor.control). That
board ends with node 0's agent, so the run's final verdict is then node 0's to show
(`rollout runs show` there); this node reports how its own workers ended.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rollout.executor.control import ControlBoard, forwards_records
from rollout.executor.launch import (
    POLL_SECONDS,
    Progress,
    Stop,
    clear_old_reports,
    copy_plan,
    supervise,
)
from rollout.executor.ownership import directory_lock, lease_seconds
from rollout.executor.preflight import verify_plan
from rollout.executor.rendezvous import check_node_rank, resolve
from rollout.planner.definition import Plan
from rollout.storage import open_store
from rollout.storage.base import FINAL_STATUSES, RunRecord, RunStore

VERDICT_GRACE_S = 10.0
"""How long after its own workers ended a joining node waits for node 0's verdict, beyond the
lease (node 0 may still be stopping its workers, or be gone: its lease then runs out)."""


@dataclass(frozen=True)
class NodeOutcome:
    """How one joining node's part of a run ended, and the run's record as node 0 left it."""

    node_rank: int
    status: str
    """This node's own: 'finished' (its workers exited 0), 'failed', or 'stopped'."""
    error: str | None
    record: RunRecord | None
    """The run as node 0 recorded it; None if node 0 never created it."""
    final: bool
    """Whether `record` holds node 0's verdict for this attempt (else node 0 has not ended it)."""
    forwarded: bool = False
    """Whether this node forwarded its records to node 0's SQLite store, which it cannot read:
    node 0's verdict is then not known here."""


def join_run(
    plan_path: str | Path, node_rank: int, *, progress: Progress | None = None
) -> NodeOutcome:
    """Run node `node_rank` (> 0) of a verified plan until this node's workers end."""
    progress = progress or Progress()
    plan = verify_plan(plan_path)
    check_node_rank(plan, node_rank)
    assert node_rank > 0, "node 0 owns the run: rollout.executor.launch.run_plan"
    run_dir = Path(plan.derived.run_dir)
    with directory_lock(run_dir, plan.run_id, lock_name=f"node-{node_rank}.lock") as owner:
        if forwards_records(plan):
            return _join_forwarding(plan, Path(plan_path), node_rank, owner.token, progress)
        store = open_store(plan.derived.store)
        try:
            watch = _NodeWatch(plan.run_id)
            watch(store)  # what the record says before this node's agent starts
            plan_copy = copy_plan(Path(plan_path), run_dir)
            clear_old_reports(plan, node_rank)
            progress.on_start(plan, False)
            status, error = supervise(
                plan,
                plan_copy,
                store,
                progress,
                owner.token,
                resolve(plan, node_rank),
                watch,
                str(plan_path),
            )
            record, final = _verdict(store, plan.run_id, watch)
            return NodeOutcome(node_rank, status, error, record, final)
        finally:
            store.close()


def _join_forwarding(
    plan: Plan, plan_path: Path, node_rank: int, token: str, progress: Progress
) -> NodeOutcome:
    """A joining node of a SQLite run: no run store here; node 0's board says when it stops."""
    plan_copy = copy_plan(plan_path, Path(plan.derived.run_dir))
    clear_old_reports(plan, node_rank)
    progress.on_start(plan, False)
    rdzv = resolve(plan, node_rank)
    status, error = supervise(
        plan,
        plan_copy,
        None,
        progress,
        token,
        rdzv,
        _BoardWatch(ControlBoard(rdzv)),
        str(plan_path),
    )
    return NodeOutcome(node_rank, status, error, None, False, forwarded=True)


class _BoardWatch:
    """What stops a joining node's workers when it cannot read the run store: node 0's word that
    it stopped the run (a cancel, a stop signal, a lost lease)."""

    def __init__(self, board: ControlBoard):
        self.board = board

    def __call__(self, store: RunStore | None) -> Stop | None:
        said = self.board.read()
        if said is None:
            return None
        if said["status"] == "stopped":  # as a cancel read from the run's record says it
            return Stop("stopped")
        return Stop(said["status"], said.get("error") or "node 0 ended the run")


class _NodeWatch:
    """What stops a joining node's workers: `rollout runs cancel`, or node 0 ending the run.

    A record that is not running says nothing until this node has seen it running: it may be an
    earlier attempt's end, before node 0 claimed the run again."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.seen_running = False

    def __call__(self, store: RunStore | None) -> Stop | None:
        assert store is not None  # this watch reads the run store
        record = store.get_run(self.run_id)
        if record is None:
            return None
        if record.status == "running":
            self.seen_running = True
            return Stop("stopped") if record.cancel_requested else None
        if self.seen_running and record.status in FINAL_STATUSES:
            return Stop(record.status, "node 0 ended the run")
        return None


def _verdict(store: RunStore, run_id: str, watch: _NodeWatch) -> tuple[RunRecord | None, bool]:
    """The run's record once node 0 has ended this attempt (or given up waiting for it)."""
    deadline = time.monotonic() + lease_seconds() + VERDICT_GRACE_S
    while True:
        watch(store)
        record = store.get_run(run_id)
        final = record is not None and watch.seen_running and record.status in FINAL_STATUSES
        if final or not watch.seen_running or time.monotonic() > deadline:
            return record, final
        time.sleep(POLL_SECONDS)
