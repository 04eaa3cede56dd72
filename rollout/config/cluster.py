"""[cluster]: how many processes on how many nodes, on which devices, running which roles."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rollout.config.base import ConfigModel

Role = Literal["actor", "learner", "reference", "critic", "reward"]
ROLES: tuple[Role, ...] = ("actor", "learner", "reference", "critic", "reward")


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
    queue_chunk_size: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="With several actor processes (cluster.placement gives 'actor' two ranks or "
        "more): how many prompts (each with its num_generations completions) an actor claims "
        "at a time from the step's work queue. Smaller balances the actors finer; larger "
        "generates in bigger batches. None: a quarter of one actor's even share, at least 1.",
    )
