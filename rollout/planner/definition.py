"""The plan: frozen data, nothing else.

A Plan is what `rollout plan` computes and plan.lock stores: the resolved config with every default,
one resolved record per reward (what the worker calls, and the identity that notices a change),
facts about the model, data and hardware, the actor/learner graph, the memory estimate, versions
and seeds. Building it (builder.py), writing and verifying it (lockfile.py) and explaining it
(explain.py) are separate modules; this one only defines it, and imports none of them.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from rollout.config.root import RunConfig
from rollout.config.rules import run_rules
from rollout.models.facts import ModelFacts
from rollout.plugins.identity import PluginIdentity

FORMAT_VERSION = 3
"""2: `rewards` (one resolved record per reward) replaced `plugins`; `derived` carries what workers used
to re-derive (per-rank sizes, total optimizer steps, where the KL goes, the reference, evaluation).
3: a model may come from the Hugging Face cache (`model.source` "hub", its snapshot directory as
`model.location` and the commit its revision resolved to as `model.commit`)."""

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


class ToolSandbox(Frozen):
    """How the run's code-running tools (or a code-running reward) are confined, as the plan's
    sandbox probe found it."""

    allow_unsandboxed: bool = Field(
        description="environment.allow_unsandboxed (tools) or rewards[i].allow_unsandboxed (a "
        "reward), as configured."
    )
    require_network_isolation: bool = Field(
        description="Whether the code is refused on a host without network isolation "
        "(False only with allow_unsandboxed on a host that lacks it)."
    )
    missing: list[str] = Field(
        description="What this host's sandbox cannot enforce, and what it falls back to (one "
        "line per capability); empty when everything works."
    )


class _Reward(Frozen):
    name: str = Field(description="Name in metrics: the config's name, else the function's.")
    weight: float = Field(description="Weight of this reward in the weighted sum.")
    options: dict[str, Any] = Field(description="Keyword arguments passed on every call.")
    timeout_s: float = Field(gt=0, description="Longest one call may take.")
    plugin: PluginIdentity = Field(
        description="What the reference resolved to, precisely enough to notice a change."
    )


class FunctionRewardRecord(_Reward):
    """A reward function (`rewards[i].fn`): the worker imports what `plugin` names."""

    kind: Literal["function"] = "function"
    sandbox: ToolSandbox | None = Field(
        default=None,
        description="The sandbox choice, when the function runs model-written code (it is "
        "passed require_network_isolation from here); None when it runs none.",
    )
    isolation: Literal["in_process", "sidecar"] = Field(
        default="in_process",
        description="Where the worker runs it: in its own process ('in_process') or in a "
        "sidecar process (rollout.plugins.sidecar), which the plan started and pinged.",
    )
    python: str | None = Field(
        default=None,
        description="The sidecar's interpreter, as resolved at plan time (None: the worker's own).",
    )
    on_error: Literal["stop", "fail_sample"] = Field(
        default="stop",
        description="rewards[i].on_error: what a sample the sidecar fails on costs (the step, "
        "or that sample, scored failure_score).",
    )
    failure_score: float = Field(
        default=0.0, description="rewards[i].failure_score (on_error = 'fail_sample')."
    )


class ModelRewardRecord(_Reward):
    """A trained reward model (`rewards[i].model`), frozen at plan time: `plugin` is its weights."""

    kind: Literal["model"] = "model"
    directory: str = Field(description="The Hugging Face directory the run scores with.")


RewardRecord = Annotated[FunctionRewardRecord | ModelRewardRecord, Field(discriminator="kind")]
"""One reward as the run calls it, resolved once by the planner: the worker builds its reward
functions from these records, never from the config again."""


class DataFacts(Frozen):
    """What a data file holds, from reading it (never from trusting the config)."""

    split: Literal["train", "eval"]
    location: str
    format: Literal["jsonl", "parquet"]
    num_records: int
    fields: list[str] = Field(description="Fields seen in the records read.")
    size_bytes: int | None = None
    fingerprint: str = Field(description="sha256 of the file's bytes.")


class SuiteFacts(Frozen):
    """An [[eval.suites]] entry's data and scorer, as planned: its rows were read and checked
    against the scorer (what `rollout eval` checks before loading weights)."""

    name: str
    location: str
    num_records: int = Field(description="Rows the suite scores (after its limit).")
    fingerprint: str = Field(description="sha256 of the data file's bytes.")
    scorer_plugin: PluginIdentity | None = Field(
        default=None, description="A plugin scorer's identity; None for a built-in scorer."
    )


class GpuFacts(Frozen):
    index: int
    name: str
    memory_bytes: int
    memory_free_bytes: int | None = Field(
        default=None,
        description="Free memory when planned (other processes hold the rest); None if unknown.",
    )


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
    precision: Literal["none", "autocast", "master_weights"] = Field(
        description="model.precision resolved: how the learner keeps weights and computes "
        "(rollout.runtime.precision).",
    )
    run_dir: DirectPath
    store: str = Field(description="Run store location (sqlite path or a DSN reference).")
    artifacts: str
    threads_per_process: Count
    prompts_per_step: Count | None = None
    prompts_per_rank: Count | None = Field(
        default=None, description="Prompts each actor process takes per step (online kinds)."
    )
    queue_chunk_size: Count | None = Field(
        default=None,
        description="Prompts per work-queue chunk when several actor processes share each "
        "step's prompts (cluster.queue_chunk_size, or a quarter of prompts_per_rank); None "
        "otherwise (one actor, or colocated roles).",
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
    reference_adapters_off: bool = Field(
        default=False,
        description="With [model.lora] and a live reference (an online kind with kl_coef > 0, "
        "DPO, IPO or KTO with reference = 'live'): the reference is the policy run with its "
        "adapters off, the base model, so no copy is held.",
    )
    adapter_parameters: Count | None = Field(
        default=None,
        description="With [model.lora]: the LoRA adapters' parameters, the only ones trained.",
    )
    logprob_temperature: float | None = Field(
        default=None,
        description="Online kinds: the temperature the learner scores completions at, the "
        "sampling temperature (1 for greedy sampling).",
    )
    evaluates: bool = Field(description="Whether the run evaluates on a held-out split.")
    max_restarts: int = Field(
        default=0,
        ge=0,
        description="cluster.max_restarts resolved: how many times the executor starts the "
        "run's processes again after a rank that holds no learner state dies.",
    )


class ToolRecord(Frozen):
    """One of environment.tools, resolved at plan time: the worker builds what this says."""

    name: str = Field(description="The tool's name, as the model calls it.")
    plugin: PluginIdentity = Field(description="The built-in's factory or the user's function.")
    options: dict[str, Any] = Field(description="A built-in's options (its factory's arguments).")
    function: dict[str, Any] | None = Field(
        description="A function tool's OpenAI declaration (from the config or its `schema`)."
    )
    runs_code: bool = Field(description="Whether it executes model-written code.")


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
    rewards: list[RewardRecord] = Field(description="One record per config.rewards entry.")
    environment: PluginIdentity | None = Field(
        default=None,
        description="What config.environment.name resolved to; None without [environment].",
    )
    environment_python: str | None = Field(
        default=None,
        description="With environment.isolation = 'sidecar': the interpreter its sidecar "
        "runs, resolved at plan time (None: the worker's own Python).",
    )
    tools: list[ToolRecord] = Field(
        default_factory=list, description="config.environment.tools resolved, in order."
    )
    tool_sandbox: ToolSandbox | None = Field(
        default=None, description="The sandbox choice, when a tool runs model-written code."
    )
    trackers: list[PluginIdentity] = Field(
        default_factory=list,
        description="What each tracker plugin in config.logging.trackers resolved to, in order "
        "(built-in trackers have none).",
    )
    engine: PluginIdentity | None = Field(
        default=None,
        description="What config.generation.engine resolved to when it is an engine plugin "
        "(None: a built-in engine).",
    )
    model: ModelFacts
    data: list[DataFacts]
    eval_suites: list[SuiteFacts] = Field(
        default_factory=list, description="One record per config.eval.suites entry."
    )
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
        if len(self.rewards) != len(self.config.rewards):
            problems.append("rewards must hold one record per config.rewards entry")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def plugins(self) -> list[PluginIdentity]:
        """The identity of every plugin the run calls: what freshness checks and explain read."""
        rewards = [reward.plugin for reward in self.rewards]
        environment = [self.environment] if self.environment is not None else []
        scorers = [suite.scorer_plugin for suite in self.eval_suites if suite.scorer_plugin]
        tools = [tool.plugin for tool in self.tools]
        engine = [self.engine] if self.engine is not None else []
        return rewards + environment + tools + scorers + list(self.trackers) + engine
