"""`rollout snapshot restore`: a new run that continues from a snapshot, on any store and artifacts.

In order, each step refusing before anything is created:

1. the snapshot is read (downloaded first when remote) and checked against its manifest;
2. the new plan: the snapshot's plan with the new run id, run directory, store and artifacts
   (derived by the planner's own functions), validated whole again, and written by the
   lockfile writer, which fingerprints it; the checks `rollout run` makes of a plan (its inputs
   unchanged, what this rollout can run) are made now;
3. the target store answers and holds no run of that id; the new artifacts hold no checkpoint;
4. then: plan.lock, the checkpoint copied under the new artifacts (its commit file last), and
   the run with its records in one transaction of the target store. A failure in (4) removes
   what (4) wrote.

`rollout run --plan NEW.lock` then finds the run in its store and the checkpoint under its
artifacts, and resumes from the snapshot's step.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rollout.errors import Issue, LockfileError, RolloutError
from rollout.files import is_url
from rollout.planner.builder import artifacts_location, store_location
from rollout.planner.definition import Plan
from rollout.planner.lockfile import read_plan, stale_reasons, write_plan
from rollout.planner.object_stores import failure_issue, quick_filesystem
from rollout.planner.runnable import run_refusals
from rollout.runtime import manifest
from rollout.snapshots import layout
from rollout.storage import check_run_id, open_store
from rollout.storage.base import CheckpointRecord, RunStore
from rollout.storage.transfer import RunRecords, import_records, load_records

Say = Callable[[str], None]


@dataclass(frozen=True)
class Restored:
    run_id: str
    plan_path: Path
    step: int
    store: str
    checkpoint: str


def restore_snapshot(
    snapshot: str,
    *,
    new_run_id: str,
    store: str | None = None,
    artifacts: str | None = None,
    output_dir: str | None = None,
    plan_out: str | None = None,
    say: Say = lambda _: None,
) -> Restored:
    """Create run `new_run_id` from `snapshot` (a directory or URL); see the module docstring.

    store: a store location (default: the snapshot's run's); artifacts: where checkpoints go
    (default: inside the new run's directory); output_dir: the parent of the new run's directory
    (default: the old run's); plan_out: where plan.lock goes (default: the new run directory).
    """
    check_run_id(new_run_id)
    with _local_copy(snapshot, say) as local:
        _verify(local, snapshot)
        old = read_plan(local / layout.PLAN_FILE, check_fresh=False)
        step = int(layout.read_json(local / layout.SNAPSHOT_FILE)["step"])
        records = _records(local, snapshot)
        plan = replan(old, new_run_id, store=store, artifacts=artifacts, output_dir=output_dir)
        _refuse_unrunnable(plan)
        target = _open_target(plan, new_run_id)
        try:
            return _create(local, plan, step, records, target, plan_out, say)
        finally:
            target.close()


def replan(
    plan: Plan,
    run_id: str,
    *,
    store: str | None,
    artifacts: str | None,
    output_dir: str | None,
) -> Plan:
    """`plan` for run `run_id` recording into `store`, checkpointing to `artifacts`. Only the run's
    identity and storage change: model, data, seeds and hardware facts are the planned ones."""
    run = plan.config.run
    if output_dir is not None:
        run = run.model_copy(update={"output_dir": output_dir})
        parent = Path(output_dir).resolve()
    else:
        parent = Path(plan.derived.run_dir).parent
    storage = plan.config.storage.model_copy(
        update={**_storage_of(store or plan.derived.store), "artifacts": artifacts}
    )
    config = plan.config.model_copy(update={"run": run, "storage": storage})
    run_dir = parent / run_id
    derived = plan.derived.model_copy(
        update={
            "run_dir": str(run_dir),
            "store": store_location(config),
            "artifacts": artifacts_location(config, run_dir),
        }
    )
    content = plan.model_copy(update={"run_id": run_id, "config": config, "derived": derived})
    try:
        # Validated whole, as reading plan.lock will: the config's rules, the run directory's name.
        return Plan.model_validate(content.model_dump(mode="json"))
    except ValueError as error:
        raise RolloutError(
            Issue("--as", f"does not make a valid plan: {error}", value=run_id)
        ) from None


def _storage_of(location: str) -> dict[str, str | None]:
    """The [storage] keys that name the store at `location`."""
    scheme, _, rest = location.partition(":")
    if scheme == "sqlite" and rest:
        return {"backend": "sqlite", "sqlite_path": str(Path(rest).expanduser().resolve())}
    if scheme == "postgres" and rest:
        return {"backend": "postgres", "postgres_dsn": rest, "sqlite_path": None}
    raise RolloutError(
        Issue(
            "--store",
            "is not a run store location",
            value=location,
            hint="use sqlite:/path/to/rollout.db or postgres:env:NAME (the variable holds the DSN)",
        )
    )


@contextlib.contextmanager
def _local_copy(snapshot: str, say: Say) -> Iterator[Path]:
    if not is_url(snapshot):
        local = Path(snapshot.removeprefix("file://"))
        if not (local / layout.SNAPSHOT_FILE).is_file():
            raise _not_a_snapshot(snapshot, "it holds no snapshot.json")
        yield local
        return
    with tempfile.TemporaryDirectory(prefix="rollout-snapshot-") as staging:
        try:
            found = _answers_with_snapshot_file(snapshot)
            size = layout.download(snapshot, Path(staging)) if found else 0
        except Exception as error:  # an endpoint, bucket or credentials problem: said in words
            raise RolloutError(
                failure_issue(error, snapshot, "SNAPSHOT", doing="read", writing=False)
            ) from None
        if not found:
            raise _not_a_snapshot(snapshot, "it holds no snapshot.json")
        say(f"downloaded {snapshot} ({size / 1e6:.1f} MB)")
        yield Path(staging)


def _answers_with_snapshot_file(snapshot: str) -> bool:
    """Whether the URL holds a snapshot.json, asked of a filesystem that fails fast: an endpoint
    that does not answer is said in seconds, not after every retry the download would make."""
    fs, path, bounded = quick_filesystem(str(layout.join(snapshot, layout.SNAPSHOT_FILE)))
    return bool(fs.exists(path, **bounded))


def _not_a_snapshot(snapshot: str, why: str) -> RolloutError:
    return RolloutError(
        Issue(
            "SNAPSHOT",
            f"is not a snapshot: {why}",
            value=snapshot,
            hint="pass the directory or URL `rollout snapshot save` printed",
        )
    )


def _verify(local: Path, snapshot: str) -> None:
    problems = manifest.problems(local)
    if problems:
        raise RolloutError(
            Issue(
                "SNAPSHOT",
                "does not match its manifest, so it is not restored: " + "; ".join(problems),
                value=snapshot,
                hint="save the snapshot again (`rollout snapshot save RUN_ID`), or restore "
                "another copy of it",
            )
        )


def _records(local: Path, snapshot: str) -> RunRecords:
    try:
        return load_records(local / layout.RECORDS_DIR)
    except (ValueError, TypeError, KeyError) as error:
        raise _not_a_snapshot(snapshot, f"its records cannot be read ({error})") from None


def _refuse_unrunnable(plan: Plan) -> None:
    """What `rollout run` would refuse of the new plan, refused now: inputs that changed or are
    not on this machine (data files, the config, plugins, versions), what this rollout cannot
    run. Hardware facts are not probed again: the run's preflight does not either."""
    issues = stale_reasons(plan) + run_refusals(plan.config, plan.graph)
    if issues:
        raise LockfileError(issues, source="the restored plan")


def _open_target(plan: Plan, run_id: str) -> RunStore:
    store = open_store(plan.derived.store)  # an unreachable store raises here, nothing made yet
    try:
        if store.get_run(run_id) is not None:
            raise RolloutError(
                Issue(
                    "--as",
                    f"a run with this id already exists in {plan.derived.store}",
                    value=run_id,
                    hint="pick another id for the restored run",
                )
            )
        from rollout.runtime.checkpoint import latest_checkpoint  # imports torch: only here

        held = latest_checkpoint(plan.derived.artifacts)
        if held is not None:
            raise RolloutError(
                Issue(
                    "--artifacts",
                    f"already holds a checkpoint ({held}): the restored run would resume from it",
                    value=plan.derived.artifacts,
                    hint="give the restored run artifacts of its own",
                )
            )
        if (Path(plan.derived.run_dir) / layout.PLAN_FILE).exists():
            raise RolloutError(
                Issue(
                    "--as",
                    f"its run directory {plan.derived.run_dir} already holds a plan.lock",
                    value=run_id,
                )
            )
    except BaseException:
        store.close()
        raise
    return store


def _create(
    local: Path,
    plan: Plan,
    step: int,
    records: RunRecords,
    store: RunStore,
    plan_out: str | None,
    say: Say,
) -> Restored:
    run_dir = Path(plan.derived.run_dir)
    plan_path = Path(plan_out) if plan_out else run_dir / layout.PLAN_FILE
    checkpoint = str(layout.join(plan.derived.artifacts, f"step-{step:06d}"))
    made_run_dir = not run_dir.exists()
    try:
        write_plan(plan, plan_path)
        lock_sha256 = json.loads(plan_path.read_text(encoding="utf-8"))["sha256"]
        layout.upload(local / layout.CHECKPOINT_DIR / f"step-{step:06d}", checkpoint)
        say(f"copied checkpoint step {step} to {checkpoint}")
        import_records(
            store,
            records,
            run_id=plan.run_id,
            plan_sha256=lock_sha256,
            plan_path=str(run_dir / layout.PLAN_FILE),
            run_dir=str(run_dir),
            checkpoint=CheckpointRecord(plan.run_id, step, checkpoint, time.time()),
        )
        say(f"created run {plan.run_id} in {plan.derived.store}: {records.counts()}")
    except BaseException:
        layout.remove(checkpoint)
        plan_path.unlink(missing_ok=True)
        if made_run_dir:
            layout.remove(run_dir)
        raise
    return Restored(plan.run_id, plan_path, step, plan.derived.store, checkpoint)
