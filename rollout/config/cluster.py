"""[cluster]: how many processes on how many nodes, on which devices, running which roles."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rollout.config.base import ConfigModel

Sharding = Literal["none", "fsdp"]
"""How the learner's weights, gradients and optimizer state sit on its ranks: "none" (every rank
holds all of them; gradients are averaged) or "fsdp" (torch FSDP2: each rank holds a 1/N shard)."""

Role = Literal["actor", "learner", "reference", "critic", "reward"]
ROLES: tuple[Role, ...] = ("actor", "learner", "reference", "critic", "reward")


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
    sharding: Sharding = Field(
        default="none",
        description="'none' (the default): every learner process holds the whole model and its "
        "optimizer state, and gradients are averaged over processes (data parallel). 'fsdp': "
        "torch FSDP2 shards weights, gradients and optimizer state over the processes (each "
        "decoder layer, then the whole model), so each holds about 1/N of them; dpo, ipo, kto "
        "and sft on 2 or more processes, without [model.lora].",
    )
    fsdp_mixed_precision: FsdpMixedPrecision | None = Field(
        default=None,
        description="With sharding = 'fsdp': compute and gradient-reduction dtypes (an empty "
        "table: bfloat16 compute, float32 reductions). None: everything in model.dtype.",
    )
