"""Where a run's nodes meet, and what to say when they do not.

Every node of a run starts its own torchrun agent (`rollout run --plan plan.lock --node-rank K`).
The agents meet through torchrun's *static* rendezvous: node 0's agent listens on
`cluster.rdzv_endpoint` (a TCPStore) and waits for the other nnodes - 1 agents to connect; the
others connect to it, retrying, for up to `cluster.rdzv_timeout_s`. Static, not c10d: only the
static rendezvous gives node K the global ranks K*nproc_per_node .. (K+1)*nproc_per_node - 1 that
the plan's graph assigns it (the c10d one numbers nodes by the order they arrive), so rank 0,
which writes checkpoints and drives the trackers, is always on node 0, the node that owns the
run. The rendezvous id is the run id: two runs sharing an endpoint by mistake never mix ranks.

A rendezvous that does not form ends torchrun with an error in its log; `rendezvous_failure`
turns that into the run's message: the endpoint, the nodes that joined and those missing, and
what to check.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass

from rollout.config.cluster import split_endpoint
from rollout.errors import Issue, RolloutError
from rollout.planner.definition import Plan

_CLIENTS_JOINED = re.compile(r"waiting for clients\. (\d+)/(\d+) clients joined")
_CONNECT_TIMEOUT = re.compile(r"timed out after \d+ms while trying to connect to")
_IN_USE = re.compile(r"address already in use|EADDRINUSE", re.IGNORECASE)


@dataclass(frozen=True)
class Rendezvous:
    """Where this run's nodes meet, resolved for one start of one node."""

    host: str
    port: int
    nnodes: int
    node_rank: int
    run_id: str
    timeout_s: float

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def torchrun_args(self) -> list[str]:
        return [
            f"--nnodes={self.nnodes}",
            f"--node_rank={self.node_rank}",
            "--rdzv_backend=static",
            f"--rdzv_endpoint={self.endpoint}",
            f"--rdzv_id={self.run_id}",
            # Node 0 waits this long for the others; the others retry connecting as long.
            f"--rdzv_conf=timeout={max(1, round(self.timeout_s))}",
        ]


def check_node_rank(plan: Plan, node_rank: int) -> None:
    """A RolloutError (exit 2) for a node rank that is not one of the plan's nodes."""
    nnodes = plan.graph.nnodes
    if not 0 <= node_rank < nnodes:
        where = "node 0 only" if nnodes == 1 else f"node ranks 0..{nnodes - 1}"
        raise RolloutError(
            Issue(
                "--node-rank",
                f"node rank {node_rank} is not a node of this plan: it has "
                f"cluster.nnodes = {nnodes} ({where})",
                value=node_rank,
                hint="start node 0 with --node-rank 0 (it owns the run) and each other node with "
                "its own rank below nnodes; on SLURM $SLURM_NODEID, on a Kubernetes indexed Job "
                "$JOB_COMPLETION_INDEX",
            )
        )


def resolve(plan: Plan, node_rank: int) -> Rendezvous:
    """The plan's endpoint; with one node and none configured, 127.0.0.1 and a free port."""
    cluster = plan.config.cluster
    if cluster.rdzv_endpoint is not None:
        host, port = split_endpoint(cluster.rdzv_endpoint)
    else:  # one node (the config rules require an endpoint for several)
        host, port = "127.0.0.1", free_port()
    return Rendezvous(host, port, plan.graph.nnodes, node_rank, plan.run_id, cluster.rdzv_timeout_s)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rendezvous_failure(rdzv: Rendezvous, torchrun_output: str, plan_path: str) -> str | None:
    """The run's message when torchrun's output shows the nodes never met, else None."""
    where = f"the rendezvous at {rdzv.endpoint} (cluster.rdzv_endpoint)"
    waited = f"cluster.rdzv_timeout_s = {rdzv.timeout_s:g} s"
    others = f"`rollout run --plan {plan_path} --node-rank K`"
    joined = _CLIENTS_JOINED.search(torchrun_output)
    if joined is not None and rdzv.nnodes > 1:
        count = int(joined.group(1))
        missing = rdzv.nnodes - count
        if count <= 1:
            present = "only node 0 (this one) joined"
            absent = "missing: " + _nodes(range(1, rdzv.nnodes))
        else:
            present = f"{count} of {rdzv.nnodes} nodes joined, node 0 (this one) among them"
            absent = f"missing: {missing} of " + _nodes(range(1, rdzv.nnodes))
        return (
            f"the run's {rdzv.nnodes} nodes did not meet: node 0 waited {waited} at {where} and "
            f"{present}; {absent}. Check that {others} was started on every other node with this "
            f"same plan.lock, each with its own K, and that those nodes can reach {rdzv.endpoint} "
            "(the host name or address as they resolve it, the port, a firewall)"
        )
    if _CONNECT_TIMEOUT.search(torchrun_output) is not None and rdzv.node_rank > 0:
        return (
            f"node {rdzv.node_rank} could not reach node 0 at {where} within {waited}. Check "
            f"that node 0 runs (`rollout run --plan {plan_path} --node-rank 0`), that "
            f"{rdzv.host} is node 0's host name or address as this node resolves it, and that "
            f"no firewall closes port {rdzv.port}"
        )
    if _IN_USE.search(torchrun_output) is not None and rdzv.node_rank == 0:
        return (
            f"node 0 could not listen at {where}: port {rdzv.port} is already in use on this "
            "machine (another run, or an earlier one still ending). Choose another free port "
            "in cluster.rdzv_endpoint and plan again"
        )
    return None


def _nodes(ranks: range) -> str:
    listed = [str(r) for r in ranks[:16]]
    more = f" and {len(ranks) - 16} more" if len(ranks) > 16 else ""
    return ("node " if len(ranks) == 1 else "nodes ") + ", ".join(listed) + more
