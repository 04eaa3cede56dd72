"""What a worker hands the loop it runs: its plan, its place among the ranks, and whether it
should stop.

A leaf of the runtime: the worker builds one, the loops (rollout.runtime.online,
rollout.runtime.offline), recording and checkpointing read it, and none of them imports the
worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from threading import Event
from typing import TYPE_CHECKING

from rollout.runtime.uploads import Uploads

if TYPE_CHECKING:
    from rollout.planner.definition import Plan
    from rollout.runtime.activity import Activity


@dataclass
class WorkerContext:
    """What a worker knows about itself: its plan, its place, and whether it should stop."""

    plan: Plan
    rank: int
    local_rank: int
    world_size: int
    stop: Event = field(default_factory=Event)
    activity: Activity | None = None
    """Where this worker is (step, plugin), for the host to report if it dies without a word."""
    uploads: Uploads = field(default_factory=Uploads)
    """The checkpoint upload in flight, if any: the worker waits for it before it ends."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> str:
        return self.plan.graph.processes[self.rank].device

    @property
    def roles(self) -> list[str]:
        return self.plan.graph.processes[self.rank].roles
