"""[cluster]: how many processes on how many nodes, on which devices, running which roles, and
where and how long the nodes wait for one another."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from rollout.config.base import ConfigModel

Sharding = Literal["none", "fsdp"]
"""How the learner's weights, gradients and optimizer state sit on its ranks: "none" (every rank
holds all of them; gradients are averaged) or "fsdp" (torch FSDP2: each rank holds a 1/N shard)."""

Role = Literal["actor", "learner", "reference", "critic", "reward"]
ROLES: tuple[Role, ...] = ("actor", "learner", "reference", "critic", "reward")

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' (or '[v6-address]:port') as (host, port); ValueError saying what is wrong."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"must be HOST:PORT (node 0's address and a free port, e.g. 'node0.cluster:29500'), "
            f"got {endpoint!r}"
        )
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"port {port} is not between 1 and 65535")
    host = host.removeprefix("[").removesuffix("]")
    if any(c.isspace() for c in host) or "/" in host:
        raise ValueError(f"{host!r} is not a host name or address")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_endpoint(endpoint: str) -> str:
    split_endpoint(endpoint)
    return endpoint


class FsdpMixedPrecision(ConfigModel):
    """[cluster.fsdp_mixed_precision]: the dtypes FSDP2 computes and reduces in (its
    MixedPrecisionPolicy); the sharded weights and the optimizer stay in model.dtype."""

    param_dtype: Literal["bfloat16", "float32"] = Field(
        default="bfloat16",
        description="The dtype each layer's weights are gathered to for the forward and backward "
        "passes (a bfloat16 copy of float32 sharded weights: bfloat16 compute, float32 updates).",
    )
    reduce_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="The dtype gradients are reduce-scattered in across ranks (float32: no "
        "rounding when every rank's gradients are summed).",
    )


class ClusterSection(ConfigModel):
    nnodes: int = Field(default=1, ge=1, le=4096, description="Number of machines.")
    nproc_per_node: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Worker processes per machine (one per GPU on GPU machines).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="Device kind. 'auto' is cuda when the planning machine has GPUs, else cpu.",
    )
    placement: dict[Role, list[Annotated[int, Field(ge=0)]]] | None = Field(
        default=None,
        description="None (the default): colocated, every process runs every role the algorithm "
        "needs. Or a table mapping each role to the global process ranks "
        "(0 .. nnodes*nproc_per_node-1) that run it, e.g. { actor = [0], learner = [1] }.",
    )
    threads_per_process: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="CPU threads each worker's torch may use. None: the CPU cores divided among "
        "the node's processes.",
    )
    rdzv_endpoint: Annotated[str, AfterValidator(_check_endpoint)] | None = Field(
        default=None,
        description="HOST:PORT where the nodes meet (the rendezvous): node 0's address as the "
        "other nodes reach it, and a port free there; node 0 listens on it. Required when "
        "nnodes > 1. None with one node: 127.0.0.1 and a free port.",
    )
    rdzv_loopback: bool = Field(
        default=False,
        description="Allow a loopback rdzv_endpoint (127.0.0.1, ::1, localhost) with nnodes > 1: "
        "every 'node' is then a process on this one machine, for testing multi-node runs. "
        "Other machines can never reach a loopback address.",
    )
    rdzv_timeout_s: float = Field(
        default=300.0,
        gt=0,
        le=86400,
        description="How long a node waits for all nnodes nodes to join the rendezvous before the "
        "run fails, naming the endpoint and the nodes missing.",
    )
    collective_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=86400,
        description="How long a rank waits in one collective (gradient averaging, a barrier) for "
        "the other ranks before the run fails, naming the rank, its role and its step. Must "
        "exceed the longest time one rank may work alone between collectives.",
    )
    max_restarts: int | None = Field(
        default=None,
        ge=0,
        le=1000,
        description="How many times the run's processes are started again after an actor rank "
        "dies (every process restarts and resumes from the newest checkpoint, redoing the steps "
        "since). Only ranks that run no learner are restarted: a rank holding learner state "
        "that dies fails the run at once. None: 3 when actors have ranks of their own "
        "([cluster.placement]), else 0; above 0 needs such ranks.",
    )
    sharding: Sharding = Field(
        default="none",
        description="'none' (the default): every learner process holds the whole model and its "
        "optimizer state, and gradients are averaged over processes (data parallel). 'fsdp': "
        "torch FSDP2 shards weights, gradients and optimizer state over the processes (each "
        "decoder layer, then the whole model), so each holds about 1/N of them; dpo, ipo, kto "
        "and sft on 2 or more processes, and grpo, rloo and reinforce_pp with actors on ranks "
        "of their own and 2 or more learners ([cluster.placement]); without [model.lora].",
    )
    fsdp_mixed_precision: FsdpMixedPrecision | None = Field(
        default=None,
        description="With sharding = 'fsdp': compute and gradient-reduction dtypes (an empty "
        "table: bfloat16 compute, float32 reductions). None: everything in model.dtype.",
    )
    queue_chunk_size: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="With several actor processes (cluster.placement gives 'actor' two ranks or "
        "more): how many prompts (each with its num_generations completions) an actor claims "
        "at a time from the step's work queue. Smaller balances the actors finer; larger "
        "generates in bigger batches. None: a quarter of one actor's even share, at least 1.",
    )
