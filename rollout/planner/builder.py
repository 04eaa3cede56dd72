"""Build a Plan from a config: the only place derived values are computed.

Stages that do not depend on each other (model, data, plugins, hardware) all run, and their
problems are reported together, so a user fixes everything in one round. Only when they all pass
are the graph and the memory estimate built.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import platform
import secrets
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import rollout.tracing as tracing
from rollout.config import load_config
from rollout.config.algorithm import ONLINE_KINDS, PAIRED_PREFERENCE_KINDS
from rollout.config.environment import episode_tokens
from rollout.config.generation import GenerationSection
from rollout.config.rewards import RewardSpec
from rollout.config.root import RunConfig
from rollout.config.rules import kl_in_reward, needed_fields
from rollout.errors import ConfigError, Issue, PlanError, RolloutError
from rollout.fingerprints import sha256_file
from rollout.models.facts import ModelFacts
from rollout.planner.definition import (
    DataFacts,
    Derived,
    FunctionRewardRecord,
    Graph,
    HardwareFacts,
    ModelRewardRecord,
    Plan,
    RewardRecord,
    Seeds,
    Versions,
)
from rollout.planner.engine import resolve_engine
from rollout.planner.eval_suites import inspect_suites
from rollout.planner.hardware import probe_hardware
from rollout.planner.inspect_data import inspect_data
from rollout.planner.inspect_model import inspect_model
from rollout.planner.inspect_samples import record_check
from rollout.planner.lora import adapter_parameters, lora_issues
from rollout.planner.memory import (
    check_fits,
    estimate_memory,
    generation_shape,
    keeps_reference_model,
    runs_live_reference,
    vllm_share_issues,
)
from rollout.planner.openings import Opening, environment_opening, tools_opening
from rollout.planner.placement import build_graph, max_restarts
from rollout.planner.reward_model import model_directory_of, resolve_reward_model
from rollout.planner.reward_sandbox import reward_sandbox
from rollout.planner.runnable import run_refusals
from rollout.planner.sidecar_check import (
    environment_sidecar_issues,
    sidecar_issues,
    sidecar_python,
)
from rollout.planner.store_check import store_issues
from rollout.planner.tools import resolve_tools
from rollout.planner.trackers import resolve_trackers, tracker_issues
from rollout.plugins.identity import PluginIdentity, installed_version
from rollout.plugins.resolve import ResolvedPlugin
from rollout.seeds import derive_seed
from rollout.version import __version__

T = TypeVar("T")


def build_plan(
    config: str | Path | RunConfig,
    *,
    overrides: Iterable[str] = (),
    base_dir: str | Path | None = None,
    hardware: HardwareFacts | None = None,
    run_id: str | None = None,
    created_at: datetime | None = None,
) -> Plan:
    """Validate, inspect and freeze. Raises ConfigError or PlanError with every problem found.

    config: a config file path, or an already validated RunConfig (then ``base_dir`` says where
        its relative paths start; default the working directory).
    hardware: facts to plan for instead of probing this machine (tests, planning for elsewhere).
    """
    config_path: Path | None = None
    if isinstance(config, RunConfig):
        run_config = config
    else:
        try:
            config_path = Path(config).resolve()
        except (ValueError, OSError) as error:  # a NUL in the path, a loop of symbolic links
            raise ConfigError(
                Issue(repr(str(config)), f"is not a usable config file path: {error}")
            ) from None
        run_config = load_config(config_path, overrides)
    # The plan is a trace of its own ([logging] otlp_endpoint), its stages spans inside it. Without
    # OpenTelemetry installed nothing is exported: the plan then refuses the endpoint (below).
    endpoint = run_config.logging.otlp_endpoint
    if endpoint is not None and tracing.missing_package() is not None:
        endpoint = None
    with (
        tracing.exporting(endpoint, "rollout-plan"),
        tracing.span("plan", **{"rollout.run_name": run_config.run.name}),
    ):
        return _build(run_config, config_path, base_dir, hardware, run_id, created_at)


def _build(
    run_config: RunConfig,
    config_path: Path | None,
    base_dir: str | Path | None,
    hardware: HardwareFacts | None,
    run_id: str | None,
    created_at: datetime | None,
) -> Plan:
    base = (
        Path(base_dir).resolve()
        if base_dir
        else (config_path.parent if config_path else Path.cwd())
    )

    issues: list[Issue] = []
    hardware = hardware or probe_hardware()
    with tracing.span("plan.model"):
        model = _collect(issues, lambda: inspect_model(run_config.model, base_dir=base))
    # The tools and the environment come first: an episode opens with what they write (the
    # tools' declarations, a plugin's first observation), which the data check counts against
    # max_prompt_tokens.
    tools = resolve_tools(run_config, base, issues)
    resolved_environment = _resolve_environment(run_config, base, issues)
    environment = resolved_environment.identity if resolved_environment is not None else None
    opening = _opening(run_config, tools.instructions, resolved_environment)
    try:
        with tracing.span("plan.data"):
            data = _inspect_all_data(run_config, base, issues, model, opening)
    finally:
        if opening is not None:
            opening.close()
    fields = _reward_fields(run_config, data)
    with tracing.span("plan.rewards"):
        rewards = _resolve_rewards(run_config, base, fields, issues)
    environment_python = _environment_sidecar(run_config, environment, base, issues)
    eval_suites = inspect_suites(run_config, base, issues)
    device = _resolve_device(run_config, hardware, issues)
    if model is not None:
        issues.extend(_context_issues(run_config, model))
        issues.extend(_remote_code_issues(run_config, model))
        issues.extend(lora_issues(run_config.model.lora, model))
    issues.extend(_device_issues(run_config, device))
    if run_config.algorithm.kind in ONLINE_KINDS:
        issues.extend(
            cuda_graph_issues(
                run_config.generation,
                device,
                model.model_type if model is not None else None,
                where=f"cluster.device = {run_config.cluster.device!r}",
            )
        )
    issues.extend(tracker_issues(run_config))
    trackers = resolve_trackers(run_config, base, issues)
    engine = resolve_engine(run_config, base, issues)
    issues.extend(store_issues(run_config))
    graph = build_graph(run_config, device) if device is not None else None
    if graph is not None:
        issues.extend(_learner_split_issues(run_config, graph))
    # What `run` cannot do yet is refused now, by the same checks its preflight makes.
    issues.extend(run_refusals(run_config, graph))
    issues.extend(_thread_issues(run_config, hardware))
    if issues:
        raise PlanError(issues, source=str(config_path) if config_path else None)
    assert model is not None and graph is not None  # no issues means every stage produced

    when = (created_at or datetime.now(timezone.utc)).replace(microsecond=0)
    run_id = run_id or make_run_id(run_config.run.name, when)
    derived = _derive(run_config, data, hardware, graph, run_id, model)
    shape = generation_shape(run_config, model, graph, derived, data)
    memory = estimate_memory(run_config, model, graph, derived, hardware, shape)
    check_fits(
        memory,
        source=str(config_path) if config_path else None,
        shape=shape,
        extra=vllm_share_issues(run_config, model, derived, hardware, graph, shape),
    )
    return Plan(
        run_id=run_id,
        created_at=when.isoformat(),
        config_path=str(config_path) if config_path else None,
        config_sha256=sha256_file(config_path) if config_path else None,
        base_dir=str(base),
        config=run_config,
        derived=derived,
        rewards=rewards,
        environment=environment,
        environment_python=environment_python,
        tools=tools.records,
        tool_sandbox=tools.sandbox,
        trackers=trackers,
        engine=engine,
        model=model,
        data=data,
        eval_suites=eval_suites,
        hardware=hardware,
        graph=graph,
        memory=memory,
        versions=current_versions(),
        seeds=_seeds(run_config.run.seed, graph.world_size),
    )


def _collect(issues: list[Issue], stage: Callable[[], T]) -> T | None:
    """Run one planning stage; keep its issues instead of stopping at the first stage."""
    try:
        return stage()
    except RolloutError as error:
        issues.extend(error.issues)
        return None


# --- data --------------------------------------------------------------------------------------


def _required_fields(config: RunConfig) -> dict[str, str]:
    """Role -> record field every record must have: what the algorithm needs, plus every field
    the user mapped explicitly (a mapped field that is missing is a mistake either way)."""
    mapping = config.data.fields
    needed = {name for group in needed_fields(config.algorithm.kind) for name in group}
    roles = needed | mapping.model_fields_set
    return {role: getattr(mapping, role) for role in sorted(roles) if getattr(mapping, role)}


def _inspect_all_data(
    config: RunConfig,
    base: Path,
    issues: list[Issue],
    model: ModelFacts | None,
    opening: Opening | None = None,
) -> list[DataFacts]:
    required = _required_fields(config)
    # Offline objectives tokenize every record with the model's tokenizer (lengths, labels).
    check, run_issues = record_check(config, model, base, opening)
    issues.extend(run_issues)
    mapping = config.data.fields
    paired = None
    if config.algorithm.kind in PAIRED_PREFERENCE_KINDS and mapping.chosen and mapping.rejected:
        paired = (mapping.chosen, mapping.rejected)
    facts = []
    splits = [("train", config.data.train), ("eval", config.data.eval)]
    for split, source in splits:
        if source is None:
            continue
        found = _collect(
            issues,
            lambda s=source, n=split: inspect_data(
                s, split=n, base_dir=base, required=required, paired=paired, check=check
            ),
        )
        if found is not None:
            facts.append(found)
    return facts


def _reward_fields(config: RunConfig, data: list[DataFacts]) -> dict[str, set[str]]:
    """Per split, the keyword arguments a reward can count on: the records' own fields and the
    mapped roles (rollout.runtime.online.actor.PromptFormat.reward_row). The train split is always there,
    with the roles alone when its data could not be read."""
    roles = {role for role, field in config.data.fields.model_dump().items() if field is not None}
    fields = {"train": set(roles)}
    for facts in data:
        fields[facts.split] = set(facts.fields) | roles
    return fields


# --- plugins -----------------------------------------------------------------------------------


def _resolve_rewards(
    config: RunConfig, base: Path, fields: dict[str, set[str]], issues: list[Issue]
) -> list[RewardRecord]:
    """One record per reward, each resolved here once: the worker calls what the records say."""
    from rollout.harness.reward_contract import (
        SANDBOX_KEYWORD,
        accepted_keywords,
        check_reward_signature,
    )
    from rollout.plugins.probe import probe_imports
    from rollout.plugins.registry import KINDS, REWARD_GROUP
    from rollout.plugins.resolve import import_probe, resolve_plugin

    builtins, group = KINDS["reward"].load_builtins(), REWARD_GROUP
    # A plugin whose import hangs or crashes the interpreter is found in a child process first.
    probes = [
        import_probe(
            spec.fn, base_dir=base, used_by=f"rewards[{i}].fn", group=group, builtins=builtins
        )
        for i, spec in enumerate(config.rewards)
        if spec.fn is not None
    ]
    failed = probe_imports([p for p in probes if p is not None])
    issues.extend(failed.values())
    records: list[RewardRecord] = []
    # The fields some reward reads; None once one takes **kwargs (every field). A trained
    # reward model scores (prompt, completion) alone.
    readers: frozenset[str] | None = frozenset()
    for i, spec in enumerate(config.rewards):
        if spec.model is not None:
            found = _collect(
                issues, lambda s=spec, u=f"rewards[{i}].model": _reward_model(s, base, u)
            )
            records.extend([found] if found is not None else [])
            continue
        if f"rewards[{i}].fn" in failed:
            readers = None  # cannot know what it reads
            continue
        used_by = f"rewards[{i}].fn"
        resolved = _collect(
            issues,
            lambda s=spec, u=used_by: resolve_plugin(
                s.fn, base_dir=base, used_by=u, group=group, builtins=builtins
            ),
        )
        if resolved is None:
            continue
        sandbox = reward_sandbox(spec, i, resolved.fn, issues)
        isolation = _sidecar(spec, i, resolved.identity, base, issues)
        records.append(
            FunctionRewardRecord(
                **_reward_settings(spec, resolved.identity), sandbox=sandbox, **isolation
            )
        )
        accepted = accepted_keywords(resolved.fn)
        readers = None if readers is None or accepted is None else readers | accepted
        # The worker adds the sandbox decision to the options of a reward that runs code.
        passed = spec.options if sandbox is None else {**spec.options, SANDBOX_KEYWORD: True}
        issues.extend(
            check_reward_signature(
                resolved.fn,
                options=passed,
                fields=fields["train"],
                eval_fields=fields.get("eval"),
                used_by=used_by,
                ref=spec.fn,
            )
        )
    # An environment gets every field of its rows (what it reads is its own business).
    if readers is not None and config.algorithm.kind in ONLINE_KINDS and not _plays(config):
        issues.extend(_unread_roles(config, readers))
    return records


def _opening(
    config: RunConfig, tool_instructions: str | None, environment: ResolvedPlugin | None
) -> Opening | None:
    """How an episode opens, where the plan can know it (rollout.planner.openings)."""
    if tool_instructions is not None and config.data.fields.prompt is not None:
        return tools_opening(tool_instructions, config.data.fields.prompt)
    if environment is not None:
        return environment_opening(config, environment.fn)
    return None


def _resolve_environment(
    config: RunConfig, base: Path, issues: list[Issue]
) -> ResolvedPlugin | None:
    """What [environment] names, imported once here; its options checked against its signature
    (and a built-in built with them, so a bad value fails now rather than at step 1)."""
    from rollout.harness.environments import BUILTIN_ENVIRONMENTS
    from rollout.harness.memory import takes_memory
    from rollout.plugins.probe import probe_imports
    from rollout.plugins.registry import ENVIRONMENT_GROUP, KINDS
    from rollout.plugins.resolve import import_probe, resolve_plugin

    spec = config.environment
    if spec is None or config.algorithm.kind not in ONLINE_KINDS:
        return None
    where = {
        "base_dir": base,
        "used_by": "environment.name",
        "group": ENVIRONMENT_GROUP,
        "builtins": KINDS["environment"].load_builtins(),
    }
    probe = import_probe(spec.name, **where)
    failed = probe_imports([probe] if probe is not None else [])
    if failed:
        issues.extend(failed.values())
        return None
    resolved = _collect(issues, lambda: resolve_plugin(spec.name, **where))
    if resolved is None or spec.is_single_turn or spec.is_tools:
        return resolved
    if spec.is_agent:
        issues.extend(_agent_issues(spec.options, base))
        return resolved
    remembers = takes_memory(resolved.fn)
    if remembers and "memory" in spec.options:
        issues.append(
            Issue(
                "environment.options.memory",
                "memory is the run's episodic memory, which the run passes itself",
                hint="remove environment.options.memory",
            )
        )
        return None
    world = config.cluster.nnodes * config.cluster.nproc_per_node
    if remembers and world > 1 and not _one_actor_apart(config.cluster.placement):
        issues.append(
            Issue(
                "environment.name",
                f"{spec.name} keeps an episodic memory, which is kept in one process for now: "
                f"this run has {world} that play episodes",
                value=spec.name,
                hint="set cluster.nproc_per_node = 1 and cluster.nnodes = 1, or give one actor "
                "a process of its own, e.g. placement = { actor = [0], learner = [1] }",
            )
        )
        return None
    try:
        inspect.signature(resolved.fn).bind(
            **spec.options, **({"memory": None} if remembers else {})
        )
    except TypeError as error:
        issues.append(
            Issue(
                "environment.options",
                f"{spec.name} cannot be built with these options: {error}",
                value=spec.options,
                hint="pass only the keyword arguments it takes (see its signature or docs)",
            )
        )
        return None
    except ValueError:
        pass  # a callable without a signature (a C extension type): built at run time
    if spec.name in BUILTIN_ENVIRONMENTS:
        try:
            built = resolved.fn(**spec.options)
        except (ValueError, TypeError, ImportError) as error:
            issues.append(
                Issue(
                    "environment.options",
                    str(error),
                    value=spec.options,
                    hint="see docs/environments.md for its options",
                )
            )
            return None
        close = getattr(built, "close", None)
        if callable(close):
            close()
    return resolved


def _environment_sidecar(
    config: RunConfig, identity: PluginIdentity | None, base: Path, issues: list[Issue]
) -> str | None:
    """A sidecar environment's interpreter, once its sidecar was built with its options and
    pinged here (the worker's, started the same way)."""
    from rollout.harness.memory import takes_memory
    from rollout.plugins.resolve import load_plugin

    spec = config.environment
    if spec is None or spec.isolation != "sidecar" or identity is None:
        return None
    if takes_memory(load_plugin(identity)):
        issues.append(
            Issue(
                "environment.isolation",
                f"{spec.name} keeps an episodic memory, which lives in the worker: it cannot run "
                "in a sidecar",
                value="sidecar",
                hint="remove environment.isolation",
            )
        )
        return None
    python, problem = sidecar_python(spec.python, "environment.python", base)
    if problem is not None:
        issues.append(problem)
        return None
    issues.extend(environment_sidecar_issues(spec, identity, python))
    return python


def _one_actor_apart(placement: dict[str, list[int]] | None) -> bool:
    """Whether a placement puts one actor on a process of its own: the only process that plays
    episodes, so the one that keeps an environment's memory (the learners checkpoint it:
    rollout.runtime.online.carried_memory)."""
    if placement is None:
        return False
    actors = set(placement.get("actor", []))
    return len(actors) == 1 and not actors & set(placement.get("learner", []))


def _agent_issues(options: dict[str, Any], base: Path) -> list[Issue]:
    """The agent environment's options, and whether its command can be found from here."""
    from rollout.harness.agents import AgentSpec, missing_program

    try:
        agent = AgentSpec(**options)
    except (TypeError, ValueError) as error:
        return [
            Issue(
                "environment.options",
                str(error),
                value=options,
                hint='e.g. options = { command = "python agent.py", concurrency = 16 }',
            )
        ]
    missing = missing_program(agent.argv, base)
    if missing is None:
        return []
    return [
        Issue(
            "environment.options.command",
            f"cannot run the agent: {missing}",
            value=agent.command,
            hint="paths are relative to the config file's directory; `python` is the Python "
            "running rollout",
        )
    ]


def _plays(config: RunConfig) -> bool:
    """Whether the run plays an environment that scores itself (which, not [[rewards]], gets
    the rows)."""
    env = config.environment
    return env is not None and not env.is_single_turn and not env.is_tools


def _sidecar(
    spec: RewardSpec, index: int, identity: PluginIdentity, base: Path, issues: list[Issue]
) -> dict[str, Any]:
    """The record's isolation settings; a sidecar is started and pinged here first."""
    if spec.isolation != "sidecar":
        return {}
    python, problem = sidecar_python(spec.python, f"rewards[{index}].python", base)
    found = [problem] if problem is not None else sidecar_issues(spec, index, identity, python)
    issues.extend(found)
    return {
        "isolation": "sidecar",
        "python": python,
        "on_error": spec.on_error,
        "failure_score": spec.failure_score,
    }


def _reward_model(spec: RewardSpec, base: Path, used_by: str) -> ModelRewardRecord:
    """The reward model ``spec.model`` names, frozen: its directory and its weights' identity."""
    assert spec.model is not None
    identity = resolve_reward_model(spec.model, base_dir=base, used_by=used_by)
    directory = str(model_directory_of(identity))
    return ModelRewardRecord(**_reward_settings(spec, identity), directory=directory)


def _reward_settings(spec: RewardSpec, identity: PluginIdentity) -> dict[str, Any]:
    """What a reward's record holds besides its kind: how the run calls it, and what it is."""
    return {
        "name": spec.metric_name,
        "weight": spec.weight,
        "options": spec.options,
        "timeout_s": spec.timeout_s,
        "plugin": identity,
    }


def _unread_roles(config: RunConfig, readers: frozenset[str]) -> list[Issue]:
    """Mapped data.fields roles (besides the prompt) that no reward takes: accepted, then
    ignored, unless refused here."""
    mapping = config.data.fields
    written = sorted(role for role in mapping.model_fields_set if role != "prompt")
    return [
        Issue(
            f"data.fields.{role}",
            f"no reward reads the {role!r} role: none of [[rewards]] takes a {role!r} "
            "parameter (or **kwargs), so the mapping would be ignored",
            value=getattr(mapping, role),
            hint=f"remove data.fields.{role}, or give a reward function a {role!r} parameter",
        )
        for role in written
        if getattr(mapping, role) is not None and role not in readers
    ]


# --- device and shapes -------------------------------------------------------------------------


def _resolve_device(config: RunConfig, hardware: HardwareFacts, issues: list[Issue]) -> str | None:
    wanted = config.cluster.device
    gpus = len(hardware.gpus)
    if wanted == "auto":
        return "cuda" if gpus else "cpu"
    if wanted == "cuda" and not gpus:
        issues.append(
            Issue(
                "cluster.device",
                "cuda was asked for but this machine has no NVIDIA GPU",
                value="cuda",
                hint='use device = "cpu" or "auto", or plan on the GPU machine',
            )
        )
        return None
    if wanted == "cuda" and config.cluster.nnodes == 1 and config.cluster.nproc_per_node > gpus:
        issues.append(
            Issue(
                "cluster.nproc_per_node",
                f"{config.cluster.nproc_per_node} processes need as many GPUs, this machine "
                f"has {gpus}",
                value=config.cluster.nproc_per_node,
                hint=f"use nproc_per_node = {gpus} or fewer",
            )
        )
    return wanted


def _device_issues(config: RunConfig, device: str | None) -> list[Issue]:
    # float16 is refused for training on any device (rules.precision_fits_dtype).
    issues = []
    uses_generation = config.algorithm.kind in ONLINE_KINDS
    if uses_generation and config.generation.engine == "vllm":
        if device != "cuda":
            issues.append(
                Issue(
                    "generation.engine",
                    f"the vllm engine needs a CUDA GPU, and this plan runs on "
                    f"{device or 'no device'} (cluster.device = {config.cluster.device!r})",
                    value="vllm",
                    hint='use engine = "hf", or plan on a machine with an NVIDIA GPU with '
                    'cluster.device = "cuda" or "auto"',
                )
            )
        if importlib.util.find_spec("vllm") is None:
            issues.append(
                Issue(
                    "generation.engine",
                    "the vllm engine needs the vllm package, which is not installed here",
                    value="vllm",
                    hint="pip install 'rollout[vllm]' on a Linux machine with an NVIDIA GPU, or "
                    'use engine = "hf"',
                )
            )
    return issues


STATIC_DECODE_MODEL_TYPES = ("llama", "mistral", "qwen2")
"""model_types the hf engine's static decode step serves (rollout.engines.hf.static_step; the
engine checks the loaded modules too)."""


def cuda_graph_issues(
    gen: GenerationSection, device: str | None, model_type: str | None, *, where: str
) -> list[Issue]:
    """generation.cuda_graphs = true needs a CUDA device, and with the hf engine a model its
    static step serves: refused before the engine is built. `where` says what chose the device
    (for the message); `rollout generate` asks the same."""
    if gen.cuda_graphs is not True:
        return []
    issues = []
    if device is not None and not device.startswith("cuda"):
        issues.append(
            Issue(
                "generation.cuda_graphs",
                f"CUDA graphs need a CUDA GPU, and this runs on {device} ({where})",
                value=True,
                hint='remove generation.cuda_graphs (it is "auto": on where there is a GPU), or '
                "run on a machine with an NVIDIA GPU",
            )
        )
    if gen.engine == "hf" and model_type not in (None, *STATIC_DECODE_MODEL_TYPES):
        issues.append(
            Issue(
                "generation.cuda_graphs",
                f"the hf engine captures its static decode step for "
                f"{', '.join(STATIC_DECODE_MODEL_TYPES)} models; this model is {model_type!r}",
                value=True,
                hint='remove generation.cuda_graphs ("auto" decodes this model with its own '
                'forward), or use engine = "vllm"',
            )
        )
    return issues


def _thread_issues(config: RunConfig, hardware: HardwareFacts) -> list[Issue]:
    threads = config.cluster.threads_per_process
    if threads is None or threads <= hardware.cpu_count:
        return []
    return [
        Issue(
            "cluster.threads_per_process",
            f"{threads} threads per process, but this machine gives a process "
            f"{hardware.cpu_count} CPU cores: more threads than cores make every step slower",
            value=threads,
            hint=f"use {hardware.cpu_count} or fewer, or remove it (the cores are then divided "
            "among the node's processes)",
        )
    ]


def _context_issues(config: RunConfig, model: ModelFacts) -> list[Issue]:
    limit = model.context_length
    if config.algorithm.kind in ONLINE_KINDS:
        gen, env = config.generation, config.environment
        if env is not None and env.is_agent:
            return []  # the served calls' lengths are the program's: the server checks each
        if env is not None and env.max_turns > 1:
            needed = episode_tokens(gen.max_prompt_tokens, gen.max_new_tokens, env)
            if needed <= limit:
                return []
            return [
                Issue(
                    "environment.max_turns",
                    f"an episode can grow to {needed} tokens (max_prompt_tokens "
                    f"{gen.max_prompt_tokens} + max_turns {env.max_turns} x max_new_tokens "
                    f"{gen.max_new_tokens} + {env.max_turns - 1} x max_observation_tokens "
                    f"{env.max_observation_tokens}), past the model's context of {limit}",
                    value=env.max_turns,
                    hint="lower max_turns, max_new_tokens or max_observation_tokens until the "
                    f"sum is at most {limit}",
                )
            ]
        needed = gen.max_prompt_tokens + gen.max_new_tokens
        if needed > limit:
            return [
                Issue(
                    "generation.max_new_tokens",
                    f"max_prompt_tokens {gen.max_prompt_tokens} + max_new_tokens "
                    f"{gen.max_new_tokens} = {needed} exceeds the model's context of {limit}",
                    value=gen.max_new_tokens,
                    hint=f"keep their sum at or below {limit}",
                )
            ]
    elif config.algorithm.max_length > limit:
        return [
            Issue(
                "algorithm.max_length",
                f"max_length {config.algorithm.max_length} exceeds the model's context of {limit}",
                value=config.algorithm.max_length,
                hint=f"use {limit} or less",
            )
        ]
    return []


def _remote_code_issues(config: RunConfig, model: ModelFacts) -> list[Issue]:
    """model.trust_remote_code allows code a Hugging Face checkpoint ships (an `auto_map` in its
    config.json or tokenizer_config.json); with none, it would be accepted and ignored."""
    if not config.model.trust_remote_code:
        return []
    if model.format == "hf":
        directory = Path(model.location.removeprefix("file://"))
        for name in ("config.json", "tokenizer_config.json"):
            try:
                found = json.loads((directory / name).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(found, dict) and found.get("auto_map"):
                return []
    what = {"builtin": "a builtin model", "gguf": "a GGUF file"}.get(model.format, model.location)
    return [
        Issue(
            "model.trust_remote_code",
            f"{what} ships no model code (no auto_map in config.json or tokenizer_config.json): "
            "there is nothing to trust",
            value=True,
            hint="remove model.trust_remote_code",
        )
    ]


def _learner_split_issues(config: RunConfig, graph: Graph) -> list[Issue]:
    """Batches are global; each learner rank takes an equal share of every minibatch."""
    learners = _learner_count(graph)
    algo = config.algorithm
    if algo.kind in ONLINE_KINDS:
        name, minibatch = "minibatch_size", algo.minibatch_size or algo.rollout_batch_size
    else:
        name, minibatch = "batch_size", algo.batch_size
    if minibatch % learners:
        return [
            Issue(
                f"algorithm.{name}",
                f"{name} {minibatch} cannot be split evenly over {learners} learner processes",
                value=minibatch,
                hint=f"use a multiple of {learners}, or change cluster.nproc_per_node",
            )
        ]
    actors = next((len(r.ranks) for r in graph.roles if r.role == "actor"), 0)
    if actors and (algo.rollout_batch_size // algo.num_generations) % actors:
        prompts = algo.rollout_batch_size // algo.num_generations
        return [
            Issue(
                "algorithm.rollout_batch_size",
                f"{prompts} prompts per step cannot be shared evenly by {actors} actor processes",
                value=algo.rollout_batch_size,
                hint=f"use a rollout batch of {actors * algo.num_generations * max(1, prompts // actors)} "
                "or a multiple of it",
            )
        ]
    per_rank = minibatch // learners
    if algo.micro_batch_size is not None and per_rank % algo.micro_batch_size:
        return [
            Issue(
                "algorithm.micro_batch_size",
                f"each of {learners} learner processes gets {per_rank} sequences per minibatch, "
                f"which micro_batch_size {algo.micro_batch_size} does not divide",
                value=algo.micro_batch_size,
                hint=f"use a divisor of {per_rank}",
            )
        ]
    return []


def _learner_count(graph: Graph) -> int:
    return next(len(r.ranks) for r in graph.roles if r.role == "learner")


def _actor_count(graph: Graph) -> int:
    return next(len(r.ranks) for r in graph.roles if r.role == "actor")


# --- derived values ----------------------------------------------------------------------------


def _derive(
    config: RunConfig,
    data: list[DataFacts],
    hardware: HardwareFacts,
    graph: Graph,
    run_id: str,
    model: ModelFacts,
) -> Derived:
    algo = config.algorithm
    run_dir = Path(config.run.output_dir).resolve() / run_id
    learners = _learner_count(graph)
    if algo.kind in ONLINE_KINDS:
        gen = config.generation
        minibatch = algo.minibatch_size or algo.rollout_batch_size
        prompts_per_step = algo.rollout_batch_size // algo.num_generations
        # Each actor process takes an equal share (_learner_split_issues checked that it can).
        prompts_per_rank = prompts_per_step // _actor_count(graph)
        optimizer_steps = algo.rollout_batch_size // minibatch * algo.update_epochs
        total_steps = algo.max_steps
        total_optimizer_steps = total_steps * optimizer_steps
        max_len = gen.max_prompt_tokens + gen.max_new_tokens
        in_reward = kl_in_reward(config)
        # Greedy sampling has no temperature to score at: the learner scores at 1.
        logprob_temperature = gen.temperature if gen.temperature > 0 else 1.0
    else:
        minibatch = algo.batch_size
        prompts_per_step = prompts_per_rank = optimizer_steps = None
        in_reward = logprob_temperature = None
        train = next(f for f in data if f.split == "train")
        total_steps = math.ceil(train.num_records / algo.batch_size) * algo.epochs
        if algo.max_steps is not None:
            total_steps = min(total_steps, algo.max_steps)
        total_optimizer_steps = total_steps  # one optimizer step per step
        max_len = algo.max_length
    chunk = None
    if prompts_per_rank is not None and _actor_count(graph) > 1:
        # A quarter of an even share: the actors balance, and still generate in batches.
        chunk = config.cluster.queue_chunk_size or max(1, prompts_per_rank // 4)
    micro = algo.micro_batch_size or max(1, minibatch // learners)
    per_rank = max(1, minibatch // learners)
    lora = config.model.lora
    return Derived(
        dtype=_dtype(config, graph.device),
        precision=_precision(config, graph.device),
        run_dir=str(run_dir),
        store=store_location(config),
        artifacts=artifacts_location(config, run_dir),
        threads_per_process=config.cluster.threads_per_process
        or max(1, hardware.cpu_count // config.cluster.nproc_per_node),
        prompts_per_step=prompts_per_step,
        prompts_per_rank=prompts_per_rank,
        queue_chunk_size=chunk,
        minibatch_size=minibatch,
        minibatch_per_rank=per_rank,
        micro_batch_size=micro,
        grad_accumulation=max(1, per_rank // micro),
        optimizer_steps_per_step=optimizer_steps,
        total_steps=total_steps,
        total_optimizer_steps=total_optimizer_steps,
        max_sequence_length=max_len,
        kl_in_reward=in_reward,
        keeps_reference_model=keeps_reference_model(config),
        reference_adapters_off=lora is not None and runs_live_reference(config),
        adapter_parameters=adapter_parameters(lora, model) if lora is not None else None,
        logprob_temperature=logprob_temperature,
        evaluates=config.data.eval is not None and any(f.split == "eval" for f in data),
        max_restarts=max_restarts(config.cluster.max_restarts, graph),
    )


def _dtype(config: RunConfig, device: str) -> Any:
    """The weights' dtype: as set, else what the precision needs, else the device's usual."""
    precision = config.model.precision
    if config.model.dtype != "auto":
        return config.model.dtype
    if precision == "autocast":
        return "float32"
    if precision == "master_weights":
        return "bfloat16"
    if config.cluster.sharding == "fsdp":
        # The sharded weights are the float32 master copy; cluster.fsdp_mixed_precision sets
        # the dtype layers compute in.
        return "float32"
    return "float32" if device == "cpu" else "bfloat16"


def _precision(config: RunConfig, device: str) -> Any:
    """model.precision with "auto" resolved: float32 copies in the optimizer for bfloat16
    weights (their updates would round away otherwise), nothing for float32 ones or LoRA."""
    if config.model.precision != "auto":
        return config.model.precision
    if config.model.lora is not None:
        return "none"  # only the adapters train, and peft keeps them in float32
    if config.cluster.sharding == "fsdp":
        return "none"  # FSDP's mixed precision keeps float32 weights and computes in bfloat16
    return "master_weights" if _dtype(config, device) == "bfloat16" else "none"


def store_location(config: RunConfig) -> str:
    """derived.store: where the run records; also `rollout snapshot restore`'s new plan."""
    storage = config.storage
    if storage.backend == "postgres":
        return f"postgres:{storage.postgres_dsn}"
    path = storage.sqlite_path or str(Path(config.run.output_dir) / "rollout.db")
    return f"sqlite:{Path(path).resolve()}"


def artifacts_location(config: RunConfig, run_dir: Path) -> str:
    """derived.artifacts: where checkpoints go: inside `run_dir`, or under storage.artifacts in a
    directory named by the run id (the run directory's name).

    Many runs share one configured bucket or directory; each must find only its own checkpoints
    when it resumes, never another run's newest one.
    """
    location = config.storage.artifacts
    if location is None:
        return str(run_dir / "checkpoints")
    if "://" in location and not location.startswith("file://"):
        return f"{location.rstrip('/')}/{run_dir.name}"
    return str(Path(location.removeprefix("file://")).resolve() / run_dir.name)


# --- identity ----------------------------------------------------------------------------------


def make_run_id(name: str, when: datetime) -> str:
    """``NAME-YYYYmmdd-HHMMSS-xxxxxx``: sortable by time, unique, safe in paths and URLs."""
    return f"{name}-{when.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def _seeds(root: int, world_size: int) -> Seeds:
    return Seeds(
        root=root,
        data=derive_seed(root, "data"),
        sampling=derive_seed(root, "sampling"),
        per_rank=[derive_seed(root, f"rank{rank}") for rank in range(world_size)],
    )


def current_versions() -> Versions:
    """Versions read from package metadata: planning never imports torch to learn its version."""
    return Versions(
        python=platform.python_version(),
        rollout=__version__,
        pydantic=installed_version("pydantic"),
        torch=installed_version("torch"),
        transformers=installed_version("transformers"),
        vllm=installed_version("vllm"),
    )
