"""How node 0's host tells the other nodes' hosts that it ended the run, when they cannot read the
run store (SQLite, a file on node 0's machine: rollout.runtime.forwarding).

The board is one key in the TCPStore that node 0's torchrun agent hosts at `cluster.rdzv_endpoint`
(the static rendezvous's store, which every node already reaches): node 0's host sets it when it
stops its workers early (`rollout runs cancel`, a stop signal, a lost lease), as JSON
`{"status": ..., "error": ...}`, and the joining hosts read it twice a second, as they would read
the run's record. Both connect as plain clients (`wait_for_workers=False`: the rendezvous does not
count them as nodes), lazily and briefly, so a board that is not there yet, or any more, costs a
poll, never a hang. It lives as long as node 0's agent: a verdict decided after node 0's workers
ended (finished, failed) is not on it, and a joining node then reports its own workers' outcome.

torch is imported only here, and only for runs that need the board.
"""

from __future__ import annotations

import contextlib
import json
import time
from datetime import timedelta
from typing import Any

from rollout.executor.rendezvous import Rendezvous
from rollout.planner.definition import Plan

CONNECT_TIMEOUT_S = 1.0
RETRY_S = 2.0


class ControlBoard:
    """Node 0's word to the other nodes' hosts, at the rendezvous endpoint."""

    def __init__(self, rdzv: Rendezvous) -> None:
        self.rdzv = rdzv
        self.key = f"rollout/{rdzv.run_id}/ended"
        self._client: Any = None
        self._next_try = 0.0

    def _connect(self) -> Any:
        if self._client is None and time.monotonic() >= self._next_try:
            self._next_try = time.monotonic() + RETRY_S
            dist = _quiet_torch_distributed()

            with contextlib.suppress(Exception):  # not listening (yet, or any more)
                self._client = dist.TCPStore(
                    self.rdzv.host,
                    self.rdzv.port,
                    is_master=False,
                    timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
                    wait_for_workers=False,
                )
        return self._client

    def announce(self, status: str, error: str | None) -> bool:
        """Node 0 ended the run with `status`: say so (best effort; False if nobody listens)."""
        client = self._connect()
        if client is None:
            return False
        try:
            client.set(self.key, json.dumps({"status": status, "error": error}))
            return True
        except Exception:
            self._client = None
            return False

    def read(self) -> dict[str, Any] | None:
        """What node 0 announced, or None (nothing yet, or no board to read)."""
        client = self._connect()
        if client is None:
            return None
        try:
            if not client.check([self.key]):
                return None
            return json.loads(client.get(self.key).decode())
        except Exception:  # node 0's agent ended: the board with it
            self._client = None
            return None


def forwards_records(plan: Plan) -> bool:
    """Whether the ranks off node 0 forward their records to it, and the joining hosts read
    this board rather than the run store: a SQLite store with several nodes."""
    return plan.graph.nnodes > 1 and plan.derived.store.startswith("sqlite:")


def _quiet_torch_distributed() -> Any:
    """torch.distributed, imported with torch's C++ log at FATAL: a board that is not there (yet,
    or any more, once node 0's agent ended) is the expected case, and each failed connection
    would otherwise print a C++ stack trace on this node's terminal. The level is read once,
    when torch loads, and only for this host process: the variable is restored at once, so the
    workers this host starts keep the user's own."""
    import os
    import sys

    if "torch" in sys.modules:  # loaded already, at the level it was loaded with
        import torch.distributed as dist

        return dist
    before = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch.distributed as dist
    finally:
        if before is None:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = before
    return dist
