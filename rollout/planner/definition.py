"""The plan: frozen data, nothing else.

A Plan is what `rollout plan` computes and plan.lock stores: the resolved config with every default,
the identity of each plugin, facts about the model, data and hardware, the actor/learner graph,
the memory estimate, versions and seeds. Building it (builder.py), writing and verifying it
(lockfile.py) and explaining it (explain.py) are separate modules; this one only defines it.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from rollout.config.root import RunConfig
from rollout.config.rules import run_rules

FORMAT_VERSION = 2

RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
"""A run id names a directory and a store row: no '/', no whitespace, never '.' or '..'."""

Count = Annotated[int, Field(ge=1)]


def _no_parent_steps(path: str) -> str:
    if ".." in PurePath(path).parts:
        raise ValueError(f"must not climb out with '..', got {path!r}")
    return path


DirectPath = Annotated[str, AfterValidator(_no_parent_steps)]


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PluginIdentity(Frozen):
    """Who a plugin reference resolved to, precisely enough to notice when it changes."""

    used_by: str = Field(description="Config path that references it, e.g. 'rewards[0].fn'.")
    ref: str = Field(description="The reference as written in the config.")
    kind: Literal["builtin", "module", "file", "entry_point"]
    module: str = Field(description="Module name (or, for file plugins, the file's module name).")
    qualname: str = Field(description="Attribute path of the callable inside the module.")
    path: str | None = Field(default=None, description="Absolute source file, when known.")
    sha256: str | None = Field(
        default=None,
        description="sha256 of the source file: file plugins, modules outside any "
        "installed distribution, and editable installs (whose version stays put while code changes).",
    )
    distribution: str | None = Field(default=None, description="Installed distribution name.")
    version: str | None = Field(default=None, description="Installed distribution version.")
    signature: str = Field(description="The callable's signature, as inspect renders it.")


class ModelFacts(Frozen):
    """What the model is, read from config.json or GGUF metadata without loading weights."""

    source: Literal["path", "package", "builtin"]
    location: str = Field(
        description="Absolute path or URL of the model; 'builtin:NAME' for builtins."
    )
    format: Literal["hf", "gguf", "builtin"]
    fingerprint: str = Field(
        description="sha256 of the model's metadata (config.json or GGUF header)."
    )
    architecture: str
    model_type: str
    num_parameters: int
    vocab_size: int
    context_length: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    chat_template: bool = Field(
        description="Whether a chat template is available (model or override)."
    )
    quantization: str | None = Field(default=None, description="GGUF file type, e.g. 'Q4_1'.")
    file_bytes: int | None = Field(
        default=None, description="Size of the weights on disk, if known."
    )


class DataFacts(Frozen):
    """What a data file holds, from reading it (never from trusting the config)."""

    split: Literal["train", "eval"]
    location: str
    format: Literal["jsonl", "parquet"]
    num_records: int
    fields: list[str] = Field(description="Fields seen in the records read.")
    size_bytes: int | None = None
    fingerprint: str = Field(description="sha256 of the file's bytes.")


class GpuFacts(Frozen):
    index: int
    name: str
    memory_bytes: int


class HardwareFacts(Frozen):
    platform: str
    cpu_count: int = Field(description="CPU cores this process may use.")
    memory_bytes: int
    memory_available_bytes: int
    gpus: list[GpuFacts] = Field(default_factory=list)


class ProcessSpec(Frozen):
    rank: int
    node: int
    local_rank: int
    device: str = Field(description="'cpu' or 'cuda:N'.")
    roles: list[str]


class RoleSpec(Frozen):
    role: str
    ranks: list[int]
    what: str = Field(description="What the role does in this plan, in a few words.")


class Edge(Frozen):
    source: str
    target: str
    kind: Literal["rollout_queue", "weight_sync", "reference_logprobs", "rewards", "values"]
    transport: Literal["in_process", "torch_distributed"]


class Graph(Frozen):
    world_size: int
    nnodes: int
    nproc_per_node: int
    device: Literal["cpu", "cuda"]
    backend: Literal["gloo", "nccl"]
    roles: list[RoleSpec]
    processes: list[ProcessSpec]
    edges: list[Edge]


class MemoryEstimate(Frozen):
    device: str = Field(description="'cpu' (shared by a node's CPU processes) or 'cuda:N'.")
    capacity_bytes: int
    items: dict[str, int] = Field(description="Bytes by item: weights, gradients, optimizer, ...")
    total_bytes: int
    fits: bool


class Derived(Frozen):
    """Values computed from the config by the builder (the only place they are computed)."""

    dtype: Literal["float32", "bfloat16", "float16"]
    run_dir: DirectPath
    store: str = Field(description="Run store location (sqlite path or a DSN reference).")
    artifacts: str
    threads_per_process: Count
    prompts_per_step: Count | None = None
    prompts_per_rank: Count | None = Field(
        default=None, description="Prompts each actor process takes per step (online kinds)."
    )
    minibatch_size: Count
    minibatch_per_rank: Count = Field(
        description="Sequences (online) or samples (offline) of each minibatch per learner process."
    )
    micro_batch_size: Count
    grad_accumulation: Count
    optimizer_steps_per_step: Count | None = None
    total_steps: Count
    total_optimizer_steps: Count = Field(
        description="Optimizer steps of the whole run: the learning-rate schedule's length."
    )
    max_sequence_length: Count
    kl_in_reward: bool | None = Field(
        default=None,
        description="Online kinds: whether the KL to the reference goes into the token rewards "
        "(REINFORCE++, PPO with kl_penalty = 'reward') rather than the loss.",
    )
    keeps_reference_model: bool = Field(
        description="Whether a frozen copy of the policy is held beside it through training."
    )
    logprob_temperature: float | None = Field(
        default=None,
        description="Online kinds: the temperature the learner scores completions at, the "
        "sampling temperature (1 for greedy sampling).",
    )
    evaluates: bool = Field(description="Whether the run evaluates on a held-out split.")


class Versions(Frozen):
    python: str
    rollout: str
    pydantic: str | None = None
    torch: str | None = None
    transformers: str | None = None
    vllm: str | None = None


class Seeds(Frozen):
    root: int
    data: int
    sampling: int
    per_rank: list[int]


class Plan(Frozen):
    """Everything a run needs, frozen. Equal plans serialize to equal plan.lock files.

    A plan.lock is input too: reading one validates every field, the config's cross-field rules
    and the graph's shape again, so a lock edited with a recomputed hash is refused all the same.
    """

    run_id: str = Field(pattern=RUN_ID_PATTERN)
    created_at: str = Field(description="UTC time of planning, ISO 8601.")
    config_path: str | None = Field(description="Absolute path of the config file, if any.")
    config_sha256: str | None
    base_dir: str = Field(description="Directory relative input paths were resolved against.")
    config: RunConfig = Field(description="The resolved config, every default filled in.")
    derived: Derived
    plugins: list[PluginIdentity]
    model: ModelFacts
    data: list[DataFacts]
    hardware: HardwareFacts
    graph: Graph
    memory: list[MemoryEstimate]
    versions: Versions
    seeds: Seeds

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        problems = [
            str(issue) for issue in run_rules(self.config, available=set(RunConfig.model_fields))
        ]
        graph = self.graph
        if graph.world_size != graph.nnodes * graph.nproc_per_node:
            problems.append(f"graph.world_size {graph.world_size} is not nnodes x nproc_per_node")
        if [p.rank for p in graph.processes] != list(range(graph.world_size)):
            problems.append("graph.processes must hold ranks 0..world_size-1 in order")
        if len(self.seeds.per_rank) != graph.world_size:
            problems.append("seeds.per_rank must hold one seed per rank")
        if PurePath(self.derived.run_dir).name != self.run_id:
            problems.append("derived.run_dir must end in the run id")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @classmethod
    def from_file(cls, path: str, *, check_fresh: bool = True) -> Plan:
        """Read plan.lock, refusing one that was edited, is stale, or has an unknown format."""
        from rollout.planner.lockfile import read_plan

        return read_plan(path, check_fresh=check_fresh)

    def write(self, path: str) -> None:
        """Write this plan as canonical JSON with its sha256 (atomically)."""
        from rollout.planner.lockfile import write_plan

        write_plan(self, path)
