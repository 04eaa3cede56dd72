"""The episodic memory a run's checkpoint saved (rollout.harness.memory), for `rollout memory`."""

from __future__ import annotations

import json
from typing import Any

from rollout.errors import Issue, RolloutError
from rollout.files import open_binary
from rollout.harness.memory import FILE, MEMORY_DIR
from rollout.inference.checkpoints import run_checkpoints


def saved_memory(run_id: str, step: int | None, store: str | None) -> tuple[int, dict[str, Any]]:
    """(step, memory.json) of the run's newest committed checkpoint, or of its checkpoint at
    `step`; RolloutError when there is none, or it holds no memory."""
    found = run_checkpoints(run_id, store)
    committed = [c for c in found.found if not c.problems]
    if step is not None:
        committed = [c for c in committed if c.step == step]
    if not committed:
        which = f"step {step}" if step is not None else "any step"
        raise RolloutError(
            Issue(
                "run id",
                f"{run_id} has no committed checkpoint at {which} under {found.root}",
                value=run_id,
                hint=f"rollout checkpoints list {run_id}",
            )
        )
    newest = committed[-1]
    name = f"{MEMORY_DIR}/{FILE}"
    if name not in (newest.manifest or {}).get("files", {}):
        raise RolloutError(
            Issue(
                "run id",
                f"the checkpoint at step {newest.step} of {run_id} holds no episodic memory: its "
                "environment keeps none (an environment asks for it with a `memory` parameter)",
                value=run_id,
            )
        )
    with open_binary(f"{str(newest.location).rstrip('/')}/{name}") as handle:
        return newest.step, json.loads(handle.read().decode("utf-8"))
