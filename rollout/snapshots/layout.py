"""What a snapshot holds, and moving directories of files between local disk and object stores.

    <snapshot>/                     a local directory, or an s3:// or gs:// prefix
        snapshot.json               format version, the run, the step, where it came from
        plan.lock                   the run's plan, byte for byte
        checkpoint/step-000010/     the newest committed checkpoint's files, as they were
        records/                    run.json, metrics.jsonl, logs.jsonl, checkpoints.jsonl
                                    (rollout.storage.transfer), up to and including the step
        processes/                  with snapshot.process: CRIU's images of the live workers
        manifest.json               written last: size and sha256 of every other file

The manifest is a checkpoint's (rollout.runtime.manifest), so a snapshot is verified by the same
function as a checkpoint: a directory without one was cut short, one whose files differ is damaged,
and neither is restored.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout.files import is_url
from rollout.runtime import manifest

SNAPSHOT_VERSION = 1
SNAPSHOT_FILE = "snapshot.json"
PLAN_FILE = "plan.lock"
CHECKPOINT_DIR = "checkpoint"
RECORDS_DIR = "records"
PROCESSES_DIR = "processes"
STEP_DIR = re.compile(r"step-(\d+)")
COMMIT_FILES = (manifest.MANIFEST,)
"""Written after every other file of a directory: what commits it, for a checkpoint and for a
snapshot (whose readers look for it first)."""


def checkpoint_problems(checkpoint: str | Path) -> list[str]:
    """What is wrong with a checkpoint, in words; empty when it is committed and intact."""
    return manifest.problems(checkpoint)


def step_of(checkpoint: str | Path) -> int:
    name = str(checkpoint).rstrip("/").rsplit("/", 1)[-1]
    match = STEP_DIR.fullmatch(name)
    if match is None:
        raise ValueError(f"{checkpoint} is not a checkpoint directory (step-NNNNNN)")
    return int(match.group(1))


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# --- local paths and URLs alike


def join(location: str | Path, name: str) -> str | Path:
    if is_url(location):
        return f"{str(location).rstrip('/')}/{name}"
    return Path(location) / name


def exists(location: str | Path) -> bool:
    if is_url(location):
        fs, path = _filesystem(str(location))
        return bool(fs.exists(path))
    return Path(location).exists()


def files_under(location: str | Path) -> list[str]:
    """Every file under a directory or prefix, relative to it, sorted ('a/b.json')."""
    if is_url(location):
        fs, base = _filesystem(str(location))
        base = base.rstrip("/")
        return sorted(found[len(base) + 1 :] for found in fs.find(base))
    root = Path(location)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def download(location: str | Path, local: Path) -> int:
    """Copy the files under `location` into the local directory `local`; their total bytes.

    FileNotFoundError when a file vanishes on the way (a checkpoint pruned while it is copied)."""
    total = 0
    for name in files_under(location):
        target = local / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if is_url(location):
            fs, path = _filesystem(str(join(location, name)))
            fs.get_file(path, str(target))
        else:
            shutil.copyfile(Path(location) / name, target)
        total += target.stat().st_size
    return total


def upload(local: Path, location: str | Path, *, last: Sequence[str] = COMMIT_FILES) -> None:
    """Copy the local directory `local` to `location` (a new local directory or a URL prefix),
    the files named in `last` after all others: a reader that finds them finds the rest."""
    names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    ordered = [n for n in names if n not in last] + [n for n in names if n in last]
    for name in ordered:
        if is_url(location):
            fs, path = _filesystem(str(join(location, name)))
            fs.put_file(str(local / name), path)
        else:
            target = Path(location) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local / name, target)


def remove(location: str | Path) -> None:
    """Delete a directory or prefix, if it is there (cleaning up what a failed command made)."""
    with contextlib.suppress(FileNotFoundError):
        if is_url(location):
            fs, path = _filesystem(str(location))
            if fs.exists(path):
                fs.rm(path, recursive=True)
        else:
            shutil.rmtree(location)


def _filesystem(url: str) -> tuple[Any, str]:
    import fsspec  # only remote locations pay for fsspec

    return fsspec.core.url_to_fs(url)
