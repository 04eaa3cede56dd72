"""The episodic memory of a split run (actors and learners on processes of their own): it lives
in the actor's process, beside the environment that writes it, and is saved by the learners,
which write the checkpoints.

The actor sends its memory (its JSON, rollout.harness.memory) with each step's batch; the
learners keep the newest they received. When the learners checkpoint step s they have received
every batch up to s + k (algorithm.max_staleness; rollout.runtime.online.disaggregated), so the
memory they save is the actor's after sampling batch s + k, which is where a resumed actor goes
on from: the first learner sends it back with its first weights, and the actor loads it. The
plan gives an environment with memory one actor (rollout.planner.builder), as colocated it runs
in one process: one memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollout.harness.memory import FILE, EpisodicMemory
from rollout.runtime.online.batches import RolloutBatch


class CarriedMemory:
    """A learner's copy of the actor's memory: the newest received, saved with checkpoints."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None
        """None until a batch (or the checkpoint resumed from) brought one: no memory kept."""

    def take(self, batch: RolloutBatch) -> None:
        """The memory a freshly received batch carries (batches arrive in step order)."""
        if batch.actor_memory is not None:
            self.state = batch.actor_memory

    def read(self, directory: Path) -> None:
        """From a restored checkpoint's memory/ directory (rollout.runtime.checkpoint.LoopFiles);
        a checkpoint without one leaves none."""
        path = directory / FILE
        if path.is_file():
            self.state = json.loads(path.read_text(encoding="utf-8"))

    def write(self, directory: Path) -> None:
        """Into a checkpoint's staged memory/ directory, as EpisodicMemory.write writes it."""
        assert self.state is not None
        directory.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.state, sort_keys=True, allow_nan=False)
        (directory / FILE).write_text(text, encoding="utf-8")

    def header(self) -> dict[str, Any]:
        """What the first weights' header carries to the actors: the memory to go on from."""
        return {} if self.state is None else {"memory": self.state}


def restore(memory: EpisodicMemory | None, header: dict[str, Any]) -> None:
    """An actor's memory as the learners' checkpoint held it (the first weights' header)."""
    if memory is not None and "memory" in header:
        memory.load_json(header["memory"])
