"""Seeds derived from the run's root seed, one independent stream per purpose.

Standard library only: the planner derives the plan's seeds with it, and workers and batch
inference derive per-step and per-chunk seeds the same way, without importing the planner.
"""

from __future__ import annotations

import hashlib


def derive_seed(root: int, purpose: str) -> int:
    """A stable 31-bit seed for one purpose, independent of every other purpose's stream."""
    digest = hashlib.sha256(f"{root}:{purpose}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
