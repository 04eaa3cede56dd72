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
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.files import is_url, open_binary

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


# --- local paths and URLs alike


def _join(checkpoint: str | Path, name: str) -> str | Path:
    if is_url(checkpoint):
        return f"{str(checkpoint).rstrip('/')}/{name}"
    return Path(checkpoint) / name


def _open(location: str | Path) -> Any:
    return open_binary(location)


def _size(location: str | Path) -> int | None:
    if is_url(location):
        fs, path = _filesystem(str(location))
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


def _filesystem(url: str) -> tuple[Any, str]:
    import fsspec  # only remote locations pay for fsspec

    return fsspec.core.url_to_fs(url)
