"""rollout's local cache (built tiny models, dequantized GGUF weights), safe for many processes.

Several torchrun workers may ask for the same entry at once: each builds into its own temporary
directory next to the final one and renames it into place; the first rename wins and the others
discard theirs, so a reader never sees a half-built entry.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """$ROLLOUT_CACHE, else ~/.cache/rollout."""
    return Path(os.environ.get("ROLLOUT_CACHE") or Path.home() / ".cache" / "rollout")


def built_once(relative: str, build: Callable[[Path], object]) -> Path:
    """The cache directory ``relative``, calling ``build(directory)`` the first time."""
    final = cache_root() / relative
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(scratch)
        scratch.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            os.rename(scratch, final)  # atomic; fails when another process's build is there
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # still there if the build failed or lost
    return final
