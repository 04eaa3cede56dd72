"""Which way a worker's records go into the run store: straight in, or forwarded to node 0.

On Postgres, and on one node, every worker writes into the run store itself. On SQLite with
several nodes the store is a file on node 0's machine: workers on node 0 write into it, workers on
the other nodes forward their rows through the process group's store, and global rank 0 runs the
forwarder that writes them in (rollout.runtime.forwarding). The worker asks this module for its
writer's store, connects it once the process group is formed, and closes it last.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from rollout.executor.control import forwards_records
from rollout.planner.definition import Plan
from rollout.runtime.forwarding import Forwarder, ForwardingStore, PendingStore
from rollout.storage import open_store
from rollout.storage.base import RunStore

DRAIN_S = 60.0
"""How long rank 0, at the end of a run that went well, waits for the other nodes' last records
(a rank that shows no sign of life for the forwarder's silence_s is given up on sooner)."""
DRAIN_AFTER_FAILURE_S = 5.0
"""The same after this worker failed: the run's failure is not held back for records."""


class Records:
    """One worker's route into the run store."""

    def __init__(self, plan: Plan, rank: int) -> None:
        self.plan = plan
        self.rank = rank
        nodes = {p.rank: p.node for p in plan.graph.processes}
        on = forwards_records(plan)
        self.forwarded = sorted(r for r, node in nodes.items() if node != 0) if on else []
        self._pending = PendingStore() if rank in self.forwarded else None
        self._forwarder: Forwarder | None = None

    def open_store(self) -> Callable[[], RunStore]:
        """What the worker's BackgroundWriter opens (in its thread)."""
        location = self.plan.derived.store
        if self._pending is None:
            return lambda: open_store(location)
        pending, rank = self._pending, self.rank
        return lambda: ForwardingStore(pending.wait(), rank)  # type: ignore[return-value]

    def connect(self) -> None:
        """Once the process group is formed: forwarding starts (on its ranks and on rank 0)."""
        if not self.forwarded or (self._pending is None and self.rank != 0):
            return
        from rollout.runtime import transport

        kv = transport.process_group_store()
        if self._pending is not None:
            self._pending.provide(kv)
        else:
            location = self.plan.derived.store
            self._forwarder = Forwarder(
                kv, self.forwarded, lambda: open_store(location), run_id=self.plan.run_id
            )

    def give_up_waiting(self) -> None:
        """Before the worker's writer closes: on a forwarding rank whose process group never
        formed, the writer's thread stops waiting for it (and its close says so)."""
        if self._pending is not None:
            self._pending.abandon()

    def close(self, *, failed: bool) -> None:
        """After the worker's own writer closed: rank 0 drains the other nodes' records."""
        if self._forwarder is None:
            return
        try:
            self._forwarder.close(DRAIN_AFTER_FAILURE_S if failed else DRAIN_S)
        except RuntimeError as error:  # said where the host finds it; the worker's exit stands
            print(f"rollout worker: {error}", file=sys.stderr)
