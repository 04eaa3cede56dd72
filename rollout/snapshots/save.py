"""`rollout snapshot save`: a run's newest committed checkpoint, plan and records, in one place.

Consistent without stopping the run: a committed checkpoint of step N never changes (a save of a
later step goes to another directory), so copying it while the run goes on copies step N exactly;
the records are cut at N to match. A checkpoint pruned while it is copied (keep_last) makes the
copy fail; the save then starts again from the newest checkpoint, a few times at most.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollout.errors import Issue, RolloutError
from rollout.files import is_url
from rollout.planner.definition import Plan
from rollout.planner.location_check import writable_issue
from rollout.planner.lockfile import read_plan
from rollout.runtime import manifest
from rollout.snapshots import layout
from rollout.storage import check_run_id, find_run, open_store
from rollout.storage.base import RunRecord, RunStore
from rollout.storage.transfer import read_records, write_records

ATTEMPTS = 3
Say = Callable[[str], None]


@dataclass(frozen=True)
class Saved:
    location: str
    run_id: str
    step: int
    status: str
    """The run's status when it was snapshotted ('running': the run went on past `step`)."""
    records: str
    processes: bool
    """Whether CRIU images of the live workers are in it."""


def save_snapshot(
    run_id: str, *, store_location: str, to: str | None = None, say: Say = lambda _: None
) -> Saved:
    """Snapshot run `run_id` of the store at `store_location` to `to` (a new local directory or
    URL prefix; default <artifacts>/snapshots/<run>-step-N); where it went."""
    check_run_id(run_id)
    store = open_store(store_location, create=False)
    try:
        run = find_run(store, run_id, store_location)
        plan_path = Path(run.plan_path)
        plan = read_plan(plan_path, check_fresh=False)  # its hash still checked: not edited
        for attempt in range(1, ATTEMPTS + 1):
            checkpoint = _newest_checkpoint(plan, run)
            step = layout.step_of(checkpoint)
            target = to or str(
                layout.join(plan.derived.artifacts, f"snapshots/{run_id}-step-{step}")
            )
            _refuse_existing(target)
            if run.status == "running":
                say(
                    f"{run_id} is running: snapshotting its newest committed checkpoint, step {step}"
                )
            with tempfile.TemporaryDirectory(prefix="rollout-snapshot-") as staging:
                local = Path(staging)
                try:
                    size = layout.download(
                        checkpoint, local / layout.CHECKPOINT_DIR / f"step-{step:06d}"
                    )
                except FileNotFoundError:
                    if attempt == ATTEMPTS:
                        raise
                    say(f"checkpoint step {step} was pruned while copying it: starting again")
                    continue
                say(f"copied checkpoint step {step} ({size / 1e6:.1f} MB) from {checkpoint}")
                records = _records(store, run, step, local)
                say(f"records up to step {step}: {records}")
                processes = _processes(plan, run, local, say)
                (local / layout.PLAN_FILE).write_bytes(plan_path.read_bytes())
                _write_description(local, run, plan, step, store_location, str(checkpoint))
                snapshot = manifest.build_manifest(
                    local, step=step, run_id=run_id, plan=run.plan_sha256
                )
                (local / manifest.MANIFEST).write_bytes(manifest.manifest_bytes(snapshot))
                _publish(local, target)
            return Saved(target, run_id, step, run.status, records, processes)
    finally:
        store.close()
    raise AssertionError("unreachable")  # the loop returns or raises


def _newest_checkpoint(plan: Plan, run: RunRecord) -> str | Path:
    from rollout.runtime.checkpoint import latest_checkpoint  # imports torch: only here

    latest = latest_checkpoint(plan.derived.artifacts)
    if latest is None:
        raise RolloutError(
            Issue(
                "run id",
                f"run {run.run_id!r} has no committed checkpoint under "
                f"{plan.derived.artifacts}: nothing to continue from",
                hint="snapshot it after its first checkpoint (checkpoint.interval steps)",
            )
        )
    problems = layout.checkpoint_problems(latest)
    if problems:
        raise RolloutError(
            Issue(
                str(latest),
                "the run's newest checkpoint is damaged: " + "; ".join(problems),
                hint="`rollout checkpoints verify` shows every checkpoint of the run",
            )
        )
    return latest


def _refuse_existing(target: str) -> None:
    # Probed first: a bucket that is missing or refuses writes is found before anything is copied.
    unwritable = writable_issue(target, "--to", "a snapshot")
    if unwritable is not None:
        raise RolloutError(unwritable)
    if layout.exists(target):
        raise RolloutError(
            Issue(
                "--to",
                "a snapshot (or something else) is already there: a snapshot never replaces one",
                value=target,
                hint="pass another --to, or delete that one first",
            )
        )


def _records(store: RunStore, run: RunRecord, step: int, local: Path) -> str:
    at_step = [c for c in store.checkpoints(run.run_id) if c.step == step]
    # Log lines carry no step: those written up to the checkpoint's record belong to it; with no
    # record yet (its writer has not flushed), everything written so far.
    until = at_step[0].time if at_step else time.time()
    records = read_records(store, run, up_to_step=step, logs_until=until)
    write_records(records, local / layout.RECORDS_DIR)
    return records.counts()


def _processes(plan: Plan, run: RunRecord, local: Path, say: Say) -> bool:
    if not plan.config.snapshot.process:
        return False
    if run.status != "running":
        say(f"snapshot.process: {run.run_id} is {run.status}, no process to dump")
        return False
    from rollout.executor.criu import dump_run

    directory = local / layout.PROCESSES_DIR
    dump_run(run, directory)
    say(f"dumped the run's processes with CRIU ({layout.PROCESSES_DIR}/), left running")
    return True


def _write_description(
    local: Path, run: RunRecord, plan: Plan, step: int, store: str, checkpoint: str
) -> None:
    layout.write_json(
        local / layout.SNAPSHOT_FILE,
        {
            "snapshot_version": layout.SNAPSHOT_VERSION,
            "run_id": run.run_id,
            "step": step,
            "status": run.status,
            "plan_sha256": run.plan_sha256,
            "created_at": time.time(),
            "source": {
                "store": store,
                "artifacts": plan.derived.artifacts,
                "checkpoint": checkpoint,
            },
        },
    )


def _publish(local: Path, target: str) -> None:
    """`local` becomes the snapshot at `target`, its manifest last. A local target is written
    beside itself and renamed, so it appears whole; a remote one counts once its manifest is up."""
    if is_url(target):
        layout.upload(local, target)
        return
    final = Path(target)
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(f".{final.name}.partial")
    layout.remove(partial)
    layout.upload(local, partial)
    partial.rename(final)
