"""Content fingerprints, so a plan notices when a file it was built from has changed."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO

from rollout.files import open_regular

_CHUNK = 1 << 20


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(location: str | Path, *, limit: int | None = None) -> str:
    """sha256 of a local file or fsspec URL; ``limit`` hashes only the first ``limit`` bytes."""
    digest = hashlib.sha256()
    remaining = limit
    with open_binary(location) as handle:
        while remaining is None or remaining > 0:
            size = _CHUNK if remaining is None else min(_CHUNK, remaining)
            chunk = handle.read(size)
            if not chunk:
                break
            digest.update(chunk)
            if remaining is not None:
                remaining -= len(chunk)
    return digest.hexdigest()


def is_url(location: str | Path) -> bool:
    return "://" in str(location) and not str(location).startswith("file://")


def open_binary(location: str | Path) -> BinaryIO:
    """Open a local path or an fsspec URL for reading bytes.

    A local path must be a regular file: a FIFO or a device (/dev/zero) raises FileRefused (an
    OSError) instead of blocking or reading forever. Remote objects cannot be either.
    """
    if is_url(location):
        import fsspec  # only remote locations pay for fsspec

        return fsspec.open(str(location), "rb").open()
    return open_regular(str(location).removeprefix("file://"))
