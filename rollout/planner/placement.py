"""The actor/learner graph: which roles exist, which process and device runs each, how they talk.

Colocated (the default) puts every role on every process, so edges stay inside a process. An
explicit placement maps roles to global ranks; an edge between roles that do not share their ranks
goes through torch.distributed. Roles the placement leaves out follow the role they serve (reward
runs beside the actor; reference and critic beside the learner).
"""

from __future__ import annotations

from rollout.config.root import RunConfig
from rollout.config.rules import roles_for
from rollout.planner.definition import Edge, Graph, ProcessSpec, RoleSpec

ROLE_ORDER = ("actor", "reward", "reference", "critic", "learner")

_WHAT = {
    "actor": "generates completions with the {engine} engine",
    "reward": "scores completions with {n_rewards} reward function(s)",
    "reference": "{reference}: log-probs for the KL term",
    "critic": "value model: per-token value estimates for GAE",
    "learner": "computes the {kind} loss and updates the policy",
}

_FOLLOWS = {"reward": "actor", "reference": "learner", "critic": "learner"}

# (source, target, kind): the data that flows between roles, when both exist.
_EDGES = (
    ("actor", "learner", "rollout_queue"),
    ("learner", "actor", "weight_sync"),
    ("reward", "learner", "rewards"),
    ("reference", "learner", "reference_logprobs"),
    ("critic", "learner", "values"),
)


def build_graph(config: RunConfig, device: str) -> Graph:
    """Lay out roles on processes. ``device`` is the resolved kind: 'cpu' or 'cuda'."""
    cluster = config.cluster
    world = cluster.nnodes * cluster.nproc_per_node
    roles = [r for r in ROLE_ORDER if r in roles_for(config)]
    ranks = _role_ranks(roles, cluster.placement, world)
    processes = [
        ProcessSpec(
            rank=rank,
            node=rank // cluster.nproc_per_node,
            local_rank=rank % cluster.nproc_per_node,
            device="cpu" if device == "cpu" else f"cuda:{rank % cluster.nproc_per_node}",
            roles=[r for r in roles if rank in ranks[r]],
        )
        for rank in range(world)
    ]
    what = {
        "engine": config.generation.engine,
        "n_rewards": len(config.rewards),
        "kind": config.algorithm.kind,
        "reference": "the policy with its LoRA adapters off"
        if config.model.lora is not None
        else "frozen copy of the initial policy",
    }
    return Graph(
        world_size=world,
        nnodes=cluster.nnodes,
        nproc_per_node=cluster.nproc_per_node,
        device=device,
        backend="gloo" if device == "cpu" else "nccl",
        roles=[RoleSpec(role=r, ranks=ranks[r], what=_WHAT[r].format(**what)) for r in roles],
        processes=processes,
        edges=[
            Edge(
                source=src,
                target=dst,
                kind=kind,
                transport="in_process" if ranks[src] == ranks[dst] else "torch_distributed",
            )
            for src, dst, kind in _EDGES
            if src in ranks and dst in ranks
        ],
    )


def _role_ranks(
    roles: list[str], placement: dict[str, list[int]] | None, world: int
) -> dict[str, list[int]]:
    if placement is None:
        return {role: list(range(world)) for role in roles}
    ranks = {role: sorted(placement[role]) for role in roles if role in placement}
    for role in roles:
        if role not in ranks:
            ranks[role] = ranks[_FOLLOWS[role]]
    return ranks


def is_disaggregated(graph: Graph) -> bool:
    """Whether actors and learners run on processes of their own (their edge crosses processes)."""
    return any(e.transport != "in_process" for e in graph.edges)


def recording_rank(graph: Graph) -> int:
    """The rank that records metrics and writes checkpoints: the first learner (rank 0 when
    every process runs every role)."""
    return next(role.ranks[0] for role in graph.roles if role.role == "learner")


def restartable_ranks(graph: Graph) -> list[int]:
    """The ranks whose death the run survives by restarting: those that hold no learner state
    (actors and the rewards beside them). A learner's optimizer steps since its last checkpoint
    die with it, and on a colocated placement every rank is a learner."""
    return [p.rank for p in graph.processes if "learner" not in p.roles]


DEFAULT_MAX_RESTARTS = 3
"""cluster.max_restarts when unset and some rank is restartable: enough for a stray OOM kill or
a crashed engine, few enough that a fault that recurs every attempt fails the run soon."""


def max_restarts(configured: int | None, graph: Graph) -> int:
    """cluster.max_restarts resolved: as set, else DEFAULT_MAX_RESTARTS when some rank is
    restartable on a one-node run (node 0's host restarts its own agent only), else 0."""
    if configured is not None:
        return configured
    return DEFAULT_MAX_RESTARTS if restartable_ranks(graph) and graph.nnodes == 1 else 0
