"""A checkpoint's manifest: the file that commits it, written last.

    <checkpoint>/manifest.json
        {"manifest_version": 1, "step": 10, "run_id": "...", "plan": "<plan fingerprint>",
         "created_at": 1764000000.0,
         "files": {"model/model.safetensors": {"size": 538090408, "sha256": "..."}, ...}}

A directory (or object-store prefix) without a manifest is not a checkpoint: it was cut short, or
is still uploading. One whose files do not match their manifest (missing, truncated, changed) is
damaged. Neither is ever loaded. Files that the manifest does not list are ignored, so a reader
never trusts a byte the writer did not hash.

Works on local paths and fsspec URLs alike (`rollout checkpoints verify s3://...`).

`plan` is the plan's training fingerprint (`plan_fingerprint`), not the plan.lock's sha256: that
one changes with every re-plan (a new run id, the time, the free memory seen), and a re-plan that
only trains longer, logs elsewhere or runs on newer rollout must still resume. The fingerprint
covers what makes a checkpoint mean something else: the base model's weights and shape, the LoRA
adapters' shape, the algorithm kind and its critic (what the checkpoint holds beside the policy),
the training data's bytes (what the saved data cursors point into) and the number of ranks (one
cursor each). Hyperparameters, max_steps, evaluation, logging, checkpoint and storage settings,
hardware and versions may change between a checkpoint and the run that resumes it.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rollout.files import is_url, open_binary

if TYPE_CHECKING:
    from rollout.planner.definition import Plan

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


def build_manifest(directory: Path, *, step: int, run_id: str, plan: str) -> dict[str, Any]:
    """The manifest of local checkpoint `directory` as it is now: every file but the manifest."""
    files = {
        path.relative_to(directory).as_posix(): {
            "size": path.stat().st_size,
            "sha256": _sha256(path.open("rb")),
        }
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }
    return {
        "manifest_version": MANIFEST_VERSION,
        "step": step,
        "run_id": run_id,
        "plan": plan,
        "created_at": time.time(),
        "files": files,
    }


def plan_fingerprint(plan: Plan) -> str:
    """What a checkpoint must share with the run that resumes it (see the module's docstring)."""
    config = plan.config
    algorithm = config.algorithm.model_dump(mode="json")
    identity = {
        "model": {
            "fingerprint": plan.model.fingerprint,
            "architecture": plan.model.architecture,
            "num_parameters": plan.model.num_parameters,
        },
        "lora": config.model.lora.model_dump(mode="json") if config.model.lora else None,
        "algorithm": {key: algorithm[key] for key in ("kind", "critic") if key in algorithm},
        "train_data": sorted(facts.fingerprint for facts in plan.data if facts.split == "train"),
        "world_size": plan.graph.world_size,
    }
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=2, sort_keys=True).encode("utf-8")


def read_manifest(checkpoint: str | Path) -> dict[str, Any] | None:
    """The manifest of a local or remote checkpoint, or None where it has none (not committed).

    Raises ValueError for a manifest that is not one (unreadable JSON, another version).
    """
    location = _join(checkpoint, MANIFEST)
    try:
        with _open(location) as handle:
            raw = handle.read()
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(raw)
        version = manifest["manifest_version"]
        if not isinstance(manifest["files"], dict):
            raise TypeError("'files' is not a table")
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{location} is not a checkpoint manifest ({error})") from None
    if version != MANIFEST_VERSION:
        raise ValueError(
            f"{location} has manifest version {version}; this version of rollout reads "
            f"version {MANIFEST_VERSION}"
        )
    return manifest


def problems(checkpoint: str | Path, *, hashes: bool = True) -> list[str]:
    """What is wrong with a local or remote checkpoint, in words; empty when it is good.

    `hashes=False` checks presence and sizes only (cheap: for listing many checkpoints).
    """
    try:
        manifest = read_manifest(checkpoint)
    except ValueError as error:
        return [str(error)]
    return manifest_problems(checkpoint, manifest, hashes=hashes)


def manifest_problems(
    checkpoint: str | Path, manifest: dict[str, Any] | None, *, hashes: bool = True
) -> list[str]:
    """What is wrong with `checkpoint`'s files against its `manifest` (read already)."""
    if manifest is None:
        return [f"it has no {MANIFEST} (never committed: cut short or still being written)"]
    found = []
    for name, entry in manifest["files"].items():
        found.extend(_file_problems(checkpoint, name, FileEntry(**entry), hashes=hashes))
    return found


def _file_problems(
    checkpoint: str | Path, name: str, entry: FileEntry, *, hashes: bool
) -> Iterator[str]:
    location = _join(checkpoint, name)
    size = _size(location)
    if size is None:
        yield f"{name} is missing"
        return
    if size != entry.size:
        yield f"{name} has {size:,} bytes; its manifest says {entry.size:,} (truncated or changed)"
        return
    if hashes:
        digest = _sha256(_open(location))
        if digest != entry.sha256:
            yield f"{name} does not match its sha256 in the manifest (corrupted or changed)"


# --- the checkpoints under a root


STEP_DIR = re.compile(r"step-(\d+)")
"""A checkpoint's directory name: step-000010."""

State = Literal["committed", "damaged", "uncommitted"]


@dataclass(frozen=True)
class Found:
    """One checkpoint directory under a root, and what is wrong with it (empty: committed)."""

    location: str | Path
    step: int
    manifest: dict[str, Any] | None
    """None where it has none, or one that is not a manifest."""
    problems: list[str]
    written: bool
    """Whether its manifest was written (a manifest that does not parse counts: damaged)."""

    @property
    def state(self) -> State:
        if not self.problems:
            return "committed"
        return "damaged" if self.written else "uncommitted"


def step_dirs(root: str | Path) -> list[tuple[int, str | Path]]:
    """Every checkpoint directory under `root` (a URL when `root` is one), committed or not, by
    step; empty where `root` does not exist."""
    if is_url(root):
        fs, base = filesystem(str(root))
        if not fs.exists(base):
            return []
        names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(base, detail=False)]
        found = [(name, f"{str(root).rstrip('/')}/{name}") for name in names]
    else:
        directory = Path(root)
        if not directory.is_dir():
            return []
        found = [(entry.name, entry) for entry in directory.iterdir() if entry.is_dir()]
    return sorted(
        (int(match.group(1)), location)
        for name, location in found
        if (match := STEP_DIR.fullmatch(name))
    )


def inventory(root: str | Path, *, hashes: bool = False) -> list[Found]:
    """Every checkpoint under `root` by step, each with its manifest and its problems.

    Without `hashes` a checkpoint counts as committed when its manifest is there and lists files
    that are all there at their sizes: cheap enough to list a root; loading checks the hashes.
    """
    found = []
    for step, location in step_dirs(root):
        try:
            manifest = read_manifest(location)
        except ValueError as error:
            found.append(Found(location, step, None, [str(error)], written=True))
            continue
        issues = manifest_problems(location, manifest, hashes=hashes)
        found.append(Found(location, step, manifest, issues, written=manifest is not None))
    return found


def newest_committed(root: str | Path, *, below: int | None = None) -> Found | None:
    """The committed checkpoint with the highest step (under `below`, when given), or None."""
    committed = [
        found
        for found in inventory(root)
        if found.state == "committed" and (below is None or found.step < below)
    ]
    return committed[-1] if committed else None


# --- local paths and URLs alike


def _join(checkpoint: str | Path, name: str) -> str | Path:
    if is_url(checkpoint):
        return f"{str(checkpoint).rstrip('/')}/{name}"
    return Path(checkpoint) / name


def _open(location: str | Path) -> Any:
    return open_binary(location)


def _size(location: str | Path) -> int | None:
    if is_url(location):
        fs, path = filesystem(str(location))
        try:
            return int(fs.info(path)["size"])
        except FileNotFoundError:
            return None
    try:
        return Path(location).stat().st_size
    except FileNotFoundError:
        return None


def _sha256(handle: Any) -> str:
    digest = hashlib.sha256()
    with handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of `url` and the path in it."""
    import fsspec  # only remote locations pay for fsspec

    return fsspec.core.url_to_fs(url)
