"""A run's checkpoints from outside the run: list them, verify them, export one as a plain
Hugging Face model directory (what `rollout checkpoints` does; the CLI only renders).

A run's checkpoints live under its artifacts root (plan.derived.artifacts: a local directory or
an object-store URL), which its plan.lock names; the run store records each committed one. Every
check is the manifest's (rollout.runtime.manifest): a checkpoint without one was never
committed, one whose files do not match it is damaged; neither is ever exported.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.errors import Issue, RolloutError
from rollout.files import is_url
from rollout.planner.lockfile import read_plan
from rollout.runtime.manifest import (
    MANIFEST,
    STEP_DIR,
    Found,
    filesystem,
    inventory,
    problems,
    read_manifest,
)
from rollout.storage import check_run_id, default_store_location, find_run, open_store
from rollout.storage.base import CheckpointRecord

if TYPE_CHECKING:
    from rollout.planner.definition import Plan

Progress = Callable[[str], None]
"""Told what long work is starting ("downloading ...", "merging ..."), for people to see."""


@dataclass(frozen=True)
class RunCheckpoints:
    run_id: str
    root: str
    """The run's artifacts root, where its checkpoints are."""
    plan: Plan | None
    """Its plan, where its plan.lock could still be read."""
    found: list[Found]
    """Every checkpoint directory under the root, by step, checked for presence and sizes."""
    records: dict[int, CheckpointRecord]
    """The run store's record of each checkpoint it committed, by step."""


def run_checkpoints(
    run_id: str, store: str | None = None, *, hashes: bool = False
) -> RunCheckpoints:
    """The checkpoints of run `run_id` (RolloutError for an unknown run, or one whose root
    cannot be found)."""
    check_run_id(run_id)
    location = store or default_store_location()
    the_store = open_store(location, create=False)
    try:
        record = find_run(the_store, run_id, location)
        records = {r.step: r for r in the_store.checkpoints(run_id)}
    finally:
        the_store.close()
    plan = _plan_of(record.plan_path)
    root = plan.derived.artifacts if plan is not None else _root_of(records)
    if root is None:
        raise RolloutError(
            Issue(
                "run id",
                f"run {run_id}'s plan.lock ({record.plan_path}) cannot be read and the store "
                "records no checkpoint of it, so where its checkpoints are is unknown",
                hint="pass the artifacts root itself to `rollout checkpoints verify`",
            )
        )
    return RunCheckpoints(run_id, root, plan, inventory(root, hashes=hashes), records)


def _plan_of(path: str) -> Plan | None:
    try:
        return read_plan(path, check_fresh=False)
    except RolloutError:
        return None


def _root_of(records: dict[int, CheckpointRecord]) -> str | None:
    if not records:
        return None
    newest = records[max(records)].location.rstrip("/")
    return newest.rsplit("/", 1)[0]


def verify(location: str, progress: Progress = lambda _: None) -> dict[str, list[str]]:
    """Each checkpoint at `location` (one checkpoint, or a root holding several) and what is
    wrong with it, hashes included; RolloutError where there is no checkpoint at all."""
    location = location.rstrip("/") if is_url(location) else str(Path(location).resolve())
    name = location.rsplit("/", 1)[-1]
    if STEP_DIR.fullmatch(name) or _has_manifest(location):
        progress(f"verifying {location}")
        return {location: problems(location)}
    found = inventory(location)
    if not found:
        raise RolloutError(
            Issue(
                "PATH_OR_URL",
                f"{location} is neither a checkpoint nor a directory holding checkpoints "
                "(step-NNNNNN)",
                hint="give a checkpoint (…/checkpoints/step-000020) or its root "
                "(…/checkpoints, or storage.artifacts)",
            )
        )
    report = {}
    for checkpoint in found:
        progress(f"verifying {checkpoint.location}")
        report[str(checkpoint.location)] = problems(checkpoint.location)
    return report


def _has_manifest(location: str) -> bool:
    try:
        return read_manifest(location) is not None
    except ValueError:
        return True  # a manifest that does not parse: verify says so
    except OSError:
        return False


def export(
    target: str,
    destination: str,
    store: str | None = None,
    progress: Progress = lambda _: None,
) -> tuple[Found, str]:
    """Write checkpoint `target` ("RUN_ID" for its newest committed, "RUN_ID:STEP") as a plain
    Hugging Face model directory at `destination` (a new local directory or a URL); with LoRA
    adapters only, the base model with them merged in. The checkpoint is verified first."""
    from rollout.runtime.checkpoint import CheckpointError, local_copy

    run_id, _, step_text = target.partition(":")
    checkpoints = run_checkpoints(run_id, store)
    chosen = _chosen(checkpoints, step_text)
    _refuse_taken(destination)
    progress(
        f"verifying {chosen.location}" + (" (downloading it)" if is_url(chosen.location) else "")
    )
    try:
        with local_copy(chosen.location) as local, tempfile.TemporaryDirectory() as scratch:
            model_dir = local / "model"
            if not model_dir.is_dir():
                progress("merging the LoRA adapter into the base model")
                model_dir = Path(scratch, "model")
                _merge_adapter(checkpoints, local / "adapter", model_dir)
            progress(f"writing {destination}")
            _write_directory(model_dir, destination)
    except CheckpointError as error:
        raise RolloutError(
            Issue(target, str(error), hint="export an earlier step: `rollout checkpoints list`")
        ) from None
    return chosen, destination


def _chosen(checkpoints: RunCheckpoints, step_text: str) -> Found:
    committed = [f for f in checkpoints.found if f.state == "committed"]
    if step_text:
        if not step_text.isdigit():
            raise RolloutError(
                Issue("RUN_ID[:STEP]", f"step {step_text!r} is not a whole number", value=step_text)
            )
        step = int(step_text)
        matching = [f for f in checkpoints.found if f.step == step]
        if not matching:
            steps = ", ".join(str(f.step) for f in committed) or "none"
            raise RolloutError(
                Issue(
                    "RUN_ID[:STEP]",
                    f"run {checkpoints.run_id} has no checkpoint of step {step} under "
                    f"{checkpoints.root} (committed steps: {steps})",
                )
            )
        return matching[0]  # a damaged one is refused with its problems by the check
    if not committed:
        raise RolloutError(
            Issue(
                "RUN_ID",
                f"run {checkpoints.run_id} has no committed checkpoint under {checkpoints.root}",
                hint="`rollout checkpoints list` shows what is there",
            )
        )
    return committed[-1]


def _refuse_taken(destination: str) -> None:
    if is_url(destination):
        fs, path = filesystem(destination)
        taken = fs.exists(path) and bool(fs.ls(path))
    else:
        path = Path(destination)
        taken = path.exists() and (not path.is_dir() or any(path.iterdir()))
    if taken:
        raise RolloutError(
            Issue(
                "--to",
                f"{destination} exists and is not empty",
                hint="export into a new (or empty) directory",
            )
        )


def _merge_adapter(checkpoints: RunCheckpoints, adapter_dir: Path, out: Path) -> None:
    """The run's base model (as its plan describes it) with the saved adapter merged in."""
    plan = checkpoints.plan
    if plan is None or plan.config.model.lora is None:
        raise RolloutError(
            Issue(
                "RUN_ID",
                f"the checkpoint holds a LoRA adapter only, and run {checkpoints.run_id}'s "
                "plan.lock (which names its base model) cannot be read",
            )
        )
    from rollout.models.loading import load_model
    from rollout.models.lora import add_adapters

    loaded = load_model(
        plan.model,
        plan.config.model,
        dtype=plan.derived.dtype,
        device="cpu",
        base_dir=Path(plan.base_dir),
    )
    adapters = add_adapters(loaded.model, plan.config.model.lora)
    adapters.load(adapter_dir)
    adapters.save_merged(out)
    loaded.tokenizer.save_pretrained(out)


def _write_directory(source: Path, destination: str) -> None:
    files = sorted(p for p in source.rglob("*") if p.is_file() and p.name != MANIFEST)
    if is_url(destination):
        fs, path = filesystem(destination)
        fs.put(
            [str(p) for p in files],
            [f"{path.rstrip('/')}/{p.relative_to(source).as_posix()}" for p in files],
        )
        return
    for file in files:
        target = Path(destination, file.relative_to(source))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, target)
