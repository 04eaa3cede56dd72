"""Content fingerprints, so a plan notices when a file it was built from has changed.

Standard library only (and rollout.files): every layer may import it, as it does redact and files.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from rollout.files import open_binary

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


def short_hash(digest: str) -> str:
    """The start of a digest, as messages show it: 'sha256 0123abcd… → 89efcdab…'."""
    return digest[:8] + "…"
