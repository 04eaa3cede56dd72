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
        """Whether this rank records metrics and writes checkpoints: the first learner (rank 0
        when every process runs every role)."""
        return self.rank == self.role_ranks("learner")[0]

    @property
    def learners(self) -> int:
        """How many ranks train (all of them, colocated): what step metrics average over."""
        return len(self.role_ranks("learner"))

    @property
    def seed_index(self) -> int:
        """This rank's index among the ranks of its role (the learner's, on a rank that runs
        one): what its seeds, data share and saved state are keyed by, so learner i and actor i
        of a disaggregated run draw what colocated rank i draws."""
        for role in ("learner", "actor"):
            ranks = self.role_ranks(role)
            if self.rank in ranks:
                return ranks.index(self.rank)
        return self.rank

    def role_ranks(self, role: str) -> list[int]:
        """The global ranks that run `role` (none when the algorithm has no such role)."""
        return next((r.ranks for r in self.plan.graph.roles if r.role == role), [])

    @property
    def device(self) -> str:
        return self.plan.graph.processes[self.rank].device

    @property
    def roles(self) -> list[str]:
        return self.plan.graph.processes[self.rank].roles
