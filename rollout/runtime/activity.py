"""Where a worker is: its step, and the plugin code it is running, kept in a small file.

A worker that dies inside plugin code without a Python exception (`os._exit`, a segfault, the
OOM killer) cannot report anything itself. The host then reads this file (and the faulthandler
dump beside the error files) to say at which step, and inside which plugin, the worker died
(rollout.executor.failure). Each change is one small atomic write, a few per step.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from rollout.executor.failure import activity_file, fault_file

__all__ = ["Activity", "activity_file", "fault_file"]


class Activity:
    """This worker's step and current plugin, mirrored to `activity_file`."""

    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.step: int | None = None
        self.inside_of: str | None = None
        self._write()

    def at_step(self, step: int) -> None:
        self.step = step
        self._write()

    @contextlib.contextmanager
    def inside(self, what: str) -> Iterator[None]:
        """Mark the block as running `what` (e.g. "reward 'x' (rewards[0].fn = ./r.py:x)")."""
        outer, self.inside_of = self.inside_of, what
        self._write()
        try:
            yield
        finally:
            self.inside_of = outer
            self._write()

    def _write(self) -> None:
        record = {"pid": os.getpid(), "step": self.step, "inside": self.inside_of}
        temp = self.path.with_name(f".{self.path.name}.tmp")
        temp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(temp, self.path)
