"""The online RL loop (GRPO, RLOO, REINFORCE++, PPO): generate, score, update, sync, record,
checkpoint.

It reads top to bottom: build the roles from the plan, resume from the latest complete
checkpoint, then one iteration per step. Algorithm maths lives in rollout/algorithms, and what
sets one kind apart in rollout.runtime.online.algorithms; this file only moves data between the
roles.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rollout.algorithms.advantages import turn_advantages
from rollout.config.environment import episode_tokens
from rollout.engines.base import Engine, SamplingParams
from rollout.engines.build import build_engine
from rollout.harness.agents import AgentProgram, AgentSpec
from rollout.harness.environments.runner import EnvironmentRunner
from rollout.harness.environments.single_turn import SingleTurn
from rollout.harness.memory import MEMORY_DIR, EpisodicMemory, takes_memory
from rollout.harness.reward_runner import RewardRunner
from rollout.models.loading import LoadedModel, apply_chat_template, load_model
from rollout.models.lora import Adapters, add_adapters
from rollout.planner.definition import Plan
from rollout.planner.placement import is_disaggregated
from rollout.plugins.resolve import load_plugin
from rollout.plugins.sidecar.host import SidecarHost, server_argv
from rollout.runtime.checkpoint import Extra, LoopFiles
from rollout.runtime.components import build_optimizer, build_reward_functions, build_scheduler
from rollout.runtime.context import WorkerContext
from rollout.runtime.engine_plugin import load_engine_plugin
from rollout.runtime.online.actor import Actor, PromptFormat
from rollout.runtime.online.agents import AgentActor, AgentSettings
from rollout.runtime.online.algorithms import ALGORITHMS, OnlineAlgorithm
from rollout.runtime.online.critic import Critic, value_model_for
from rollout.runtime.online.episodes import EpisodeActor, EpisodeSettings, TurnFormat
from rollout.runtime.online.eval_suites import SuiteEvaluator, build_suite_evaluator
from rollout.runtime.online.evaluate import evaluate
from rollout.runtime.online.learner import Learner, LearnerKnobs
from rollout.runtime.online.prompts import load_data
from rollout.runtime.online.shaping import Scoring, TokenAdvantages
from rollout.runtime.online.tools import build_tool_environment
from rollout.runtime.phases import PhaseClock
from rollout.runtime.precision import autocast_dtype
from rollout.runtime.recording import record_means, record_metrics, record_samples
from rollout.runtime.run_state import RunState
from rollout.runtime.sidecar_environment import SidecarEnvironment
from rollout.seeds import derive_seed
from rollout.storage.writer import BackgroundWriter

log = logging.getLogger("rollout.trainer")


@dataclass
class Roles:
    actor: Actor | EpisodeActor | AgentActor
    learner: Learner
    engine: Engine
    tokenizer: object
    prompt_format: PromptFormat
    token_advantages: TokenAdvantages | None = None
    """PPO and REINFORCE++: scores the actor's batch per token before the learner sees it."""
    adapters: Adapters | None = None
    """With LoRA: the adapters the learner trains (the engine samples with them in place)."""
    suites: SuiteEvaluator | None = None
    """[[eval.suites]], scored with the engine when the held-out split is."""
    engine_shares_model: bool = True
    """The engine samples with the learner's own module (hf, and engine plugins, which are given
    it as their spec's model); False for vLLM, which keeps a copy of its own."""

    def sync_weights(self, version: int) -> None:
        """The learner's weights to the engine: a shared module is already up to date (only the
        version moves); vLLM's own copy takes every tensor in place."""
        shared = self.engine_shares_model
        self.engine.load_weights(None if shared else self.learner.model.state_dict(), version)

    def extras(self) -> dict[str, Extra]:
        return extras_of(self.learner)

    def memory_files(self, *, saving: bool) -> LoopFiles | None:
        """The agents' episodic memory as a checkpoint directory: written when `saving`, read
        when resuming; None when the environment keeps none."""
        memory = getattr(self.actor, "memory", None)
        if memory is None:
            return None
        return {MEMORY_DIR: memory.write if saving else memory.read}

    def close(self) -> None:
        """What the actor started (the agent harness's server) stops with the run."""
        close = getattr(self.actor, "close", None)
        if callable(close):
            close()

    def at_step(self, step: int) -> None:
        """What the actor's environment writes to memory now carries `step`."""
        memory = getattr(self.actor, "memory", None)
        if memory is not None:
            memory.step = step


def extras_of(learner: Learner) -> dict[str, Extra]:
    """What a checkpoint saves beside the policy: the critic, or the value head."""
    critic = learner.critic
    if critic is None:
        return {}
    if critic.shares_policy:
        return {"value_head": Extra(critic.model.head)}
    return {"critic": Extra(critic.model, critic.optimizer, critic.scheduler)}


def train(ctx: WorkerContext, writer: BackgroundWriter) -> None:
    plan = ctx.plan
    if is_disaggregated(plan.graph):  # actors and learners on processes of their own
        from rollout.runtime.online.disaggregated import train_split

        train_split(ctx, writer)
        return
    torch.manual_seed(plan.seeds.per_rank[ctx.rank])
    roles = _build_roles(ctx)
    try:
        _train_roles(ctx, writer, roles)
    finally:
        roles.close()


def _train_roles(ctx: WorkerContext, writer: BackgroundWriter, roles: Roles) -> None:
    plan, config = ctx.plan, ctx.plan.config
    algo = config.algorithm
    stream, eval_rows = load_data(ctx)
    # Every rank evaluates (a collective) when the run has an eval split or eval suites, even a
    # rank whose share of it is empty.
    evaluates = plan.derived.evaluates or roles.suites is not None
    checkpoints = RunState(
        plan.derived.artifacts,
        roles.learner.model,
        roles.tokenizer,
        roles.learner.optimizer,
        roles.learner.scheduler,
        stream,
        roles.extras(),
        roles.adapters,
    )
    start = 0
    resumed = checkpoints.resume(ctx, roles.memory_files(saving=False))
    if resumed is not None:
        start = resumed["step"]
        roles.sync_weights(resumed["policy_version"])
    elif evaluates:
        _evaluate(ctx, roles, eval_rows, writer, 0)

    log.info("training %s for steps %d..%d", algo.kind, start + 1, plan.derived.total_steps)
    for step in range(start + 1, plan.derived.total_steps + 1):
        if ctx.stop.is_set():
            log.warning("stop requested: checkpointing at step %d and exiting", step - 1)
            checkpoints.save(
                ctx,
                writer,
                step - 1,
                {"policy_version": roles.engine.policy_version},
                roles.memory_files(saving=True),
            )
            return
        started = time.perf_counter()
        clock = PhaseClock(ctx.device)
        if ctx.activity is not None:
            ctx.activity.at_step(step)
        roles.at_step(step)
        rows = stream.take(plan.derived.prompts_per_rank)
        log.debug("step %d prompts %s", step, ",".join(f"{r.epoch}:{r.index}" for r in rows))
        seed = derive_seed(plan.seeds.sampling, f"{step}:{ctx.rank}")
        with clock.phase("rollout"):  # generate and score (perf/generate_s, perf/score_s)
            rollout = roles.actor.rollout([r.record for r in rows], seed=seed)
        metrics = dict(rollout.metrics)
        batch = rollout.batch
        if roles.token_advantages is not None:
            with clock.phase("shape"):
                batch, shaping_metrics = roles.token_advantages(batch)
            metrics.update(shaping_metrics)
        with clock.phase("learn"):
            metrics.update({f"train/{k}": v for k, v in roles.learner.update(batch).items()})
        with clock.phase("sync"):
            roles.sync_weights(step)
        elapsed = time.perf_counter() - started
        metrics.update(clock.metrics())
        metrics["perf/train_s"] = sum(
            clock.seconds[name] for name in ("shape", "learn", "sync") if name in clock.seconds
        )
        metrics["perf/step_s"] = elapsed
        metrics["perf/completions_per_s"] = len(rollout.batch) * ctx.world_size / elapsed
        metrics["perf/tokens_per_s"] = metrics["perf/generated_tokens"] * ctx.world_size / elapsed
        record_metrics(ctx, writer, step, metrics)
        record_samples(ctx, writer, step, rollout.samples)

        last = step == plan.derived.total_steps
        if evaluates and (
            last or (config.run.eval_interval and step % config.run.eval_interval == 0)
        ):
            _evaluate(ctx, roles, eval_rows, writer, step)
        if last or step % config.checkpoint.interval == 0:
            checkpoints.save(
                ctx,
                writer,
                step,
                {"policy_version": roles.engine.policy_version},
                roles.memory_files(saving=True),
            )


def _evaluate(
    ctx: WorkerContext,
    roles: Roles,
    rows: list[dict[str, Any]],
    writer: BackgroundWriter,
    step: int,
) -> None:
    """Each rank scores its shard of the eval prompts; the means are over all of them. With a
    multi-turn environment, episodes instead of completions: one greedy, or run.eval_samples
    sampled, per prompt. Then the eval suites, if any."""
    if roles.suites is not None:
        roles.suites.run(ctx, writer, step)
    if not ctx.plan.derived.evaluates:
        return
    sums, count = evaluation_sums(ctx.plan, roles.actor, roles.engine, roles.prompt_format, rows)
    record_means(ctx, writer, step, sums, count)


def evaluation_sums(
    plan: Plan,
    actor: Actor | EpisodeActor | AgentActor,
    engine: Engine,
    prompt_format: PromptFormat,
    rows: list[dict[str, Any]],
) -> tuple[dict[str, float], int]:
    """The held-out metrics' sums over `rows` (this rank's shard) and how many samples they
    cover, played where the actor (and its environment) is: one greedy completion or episode
    per row, or run.eval_samples sampled ones."""
    environment = plan.config.environment
    samples = plan.config.run.eval_samples
    # The same seed at every evaluation: each compares the policy on the same draws.
    seed = derive_seed(plan.seeds.sampling, "eval")
    if environment is not None and not environment.is_single_turn:
        assert isinstance(actor, EpisodeActor | AgentActor)
        return actor.evaluate(rows, seed=seed, samples=samples)
    return evaluate(
        engine,
        prompt_format,
        actor.rewards,
        rows,
        plan.config.generation,
        samples=samples,
        seed=seed,
    )


def _build_roles(ctx: WorkerContext) -> Roles:
    """Every role of this rank, built in an order that draws the same random numbers each run."""
    plan = ctx.plan
    kind = ALGORITHMS[plan.config.algorithm.kind]
    loaded, model, adapters = _load_policy(ctx)
    engine = _build_engine(ctx, loaded, model)
    prompt_format = _prompt_format(plan.config, loaded)
    actor = _build_actor(ctx, engine, prompt_format, kind, loaded)
    # The reference is the policy as it starts: copied before any checkpoint is loaded, or with
    # LoRA the policy with its adapters off (the base weights never move).
    reference = None
    if plan.derived.keeps_reference_model:
        reference = _frozen_copy(model)
    elif plan.derived.reference_adapters_off:
        assert adapters is not None
        reference = adapters.without_adapters()
    critic = None
    if kind.critic:
        critic = _build_critic(model, plan.config.algorithm, plan.derived)
    learner = _build_learner(ctx, model, loaded.pad_token_id, reference, critic)
    return Roles(
        actor=actor,
        learner=learner,
        engine=engine,
        tokenizer=loaded.tokenizer,
        prompt_format=prompt_format,
        token_advantages=_token_advantages(ctx.plan, kind, learner, reference),
        adapters=adapters,
        suites=build_suite_evaluator(ctx, engine, loaded, model),
        engine_shares_model=plan.config.generation.engine != "vllm",
    )


def _load_policy(ctx: WorkerContext) -> tuple[LoadedModel, torch.nn.Module, Adapters | None]:
    """The policy as the plan describes it; with [model.lora] its adapters too (peft adapts the
    model in place: the same module is the learner's, the engine's and the critic's trunk)."""
    plan, config = ctx.plan, ctx.plan.config
    loaded = load_model(
        plan.model,
        config.model,
        dtype=plan.derived.dtype,
        device=ctx.device,
        base_dir=Path(plan.base_dir),
    )
    model = loaded.model.to(ctx.device)
    adapters = None
    if config.model.lora is not None:
        adapters = add_adapters(model, config.model.lora)
    if config.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return loaded, model, adapters


def _prompt_format(config: Any, loaded: LoadedModel) -> PromptFormat:
    fields = config.data.fields.model_dump()

    def encode(text: str) -> list[int]:
        if config.data.use_chat_template:
            return apply_chat_template(
                loaded.tokenizer, loaded.chat_template, text, config.data.system_prompt
            )
        return loaded.tokenizer.encode(text, add_special_tokens=True)

    return PromptFormat(
        encode=encode,
        prompt_field=fields["prompt"],
        role_fields={role: field for role, field in fields.items() if field},
    )


def _build_actor(
    ctx: WorkerContext,
    engine: Engine,
    prompt_format: PromptFormat,
    kind: OnlineAlgorithm,
    loaded: LoadedModel,
) -> Actor | EpisodeActor:
    """The single-turn actor; with [environment], the episode actor playing it."""
    return build_actor(ctx.plan, engine, prompt_format, kind, loaded, _inside_reward(ctx))


def build_actor(
    plan: Plan,
    engine: Engine,
    prompt_format: PromptFormat,
    kind: OnlineAlgorithm,
    loaded: LoadedModel,
    guard: Callable[[str], Any] | None = None,
) -> Actor | EpisodeActor | AgentActor:
    """The actor `plan` describes, on `engine` (also what `rollout plan --probe` samples with);
    `guard` wraps each reward call (see _inside_reward)."""
    algo, gen = plan.config.algorithm, plan.config.generation
    rewards = RewardRunner(build_reward_functions(plan), guard=guard)
    params = SamplingParams(
        max_new_tokens=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        stop=tuple(gen.stop),
        n=algo.num_generations,
    )
    advantage = kind.sequence_advantages(algo)
    spec = plan.config.environment
    if spec is None:
        return Actor(engine, prompt_format, rewards, advantage, params)
    assert plan.environment is not None  # the planner resolves what the config names

    def score(prompts: list[str], completions: list[str], rows: list[Any]) -> list[float]:
        return rewards.score(prompts, completions, rows).total

    if spec.is_agent:
        return _agent_actor(plan, engine, prompt_format, rewards, advantage, params, loaded)

    if spec.is_single_turn:
        environment = SingleTurn(score, prompt_format.prompt_field)
        memory = None
    elif spec.is_tools:
        environment = build_tool_environment(plan, score, prompt_format.prompt_field)
        memory = None
    elif spec.isolation == "sidecar":
        host = SidecarHost(
            server_argv(
                plan.environment_python,
                spec.name,
                plan.environment.model_dump_json(),
                build=spec.options,
            ),
            name=spec.name,
        )
        environment = SidecarEnvironment(host, timeout_s=spec.timeout_s)
        memory = None  # refused at plan time: the memory lives in the worker
    else:
        factory = load_plugin(plan.environment)
        memory = EpisodicMemory() if takes_memory(factory) else None
        extra = {} if memory is None else {"memory": memory}
        environment = factory(**spec.options, **extra)
    actor = EpisodeActor(
        rewards,
        engine,
        prompt_format,
        EnvironmentRunner(
            environment, name=spec.name, timeout_s=spec.timeout_s, on_error=spec.on_error
        ),
        TurnFormat(
            loaded.tokenizer,
            loaded.chat_template,
            plan.config.data.system_prompt,
            frozenset(loaded.eos_token_ids),
        ),
        advantage,
        # The kinds that score per token credit each answer through their returns instead.
        None
        if kind.token_advantages is not None
        else partial(
            turn_advantages,
            baseline="leave_one_out" if algo.kind == "rloo" else "mean",
            scale=getattr(algo, "scale_rewards", "none"),
        ),
        params,
        EpisodeSettings(
            max_turns=spec.max_turns,
            max_prompt_tokens=gen.max_prompt_tokens,
            max_observation_tokens=spec.max_observation_tokens,
            advantage=spec.advantage,
            failure_reward=spec.failure_reward,
        ),
    )
    actor.memory = memory
    return actor


def _agent_actor(
    plan: Plan,
    engine: Engine,
    prompt_format: PromptFormat,
    rewards: RewardRunner,
    advantage: Callable[[torch.Tensor, int], torch.Tensor],
    params: SamplingParams,
    loaded: LoadedModel,
) -> AgentActor:
    """The agent environment: its programs served the policy from this process."""
    spec = plan.config.environment
    agent = AgentSpec(**spec.options)
    return AgentActor(
        rewards,
        engine,
        prompt_format,
        AgentProgram(agent.argv, Path(plan.base_dir), spec.timeout_s),
        advantage,
        params,
        AgentSettings(
            concurrency=agent.concurrency,
            max_calls=spec.max_turns,
            failure_reward=spec.failure_reward,
            stop_on_failure=spec.on_error == "stop",
        ),
        tokenizer=loaded.tokenizer,
        chat_template=loaded.chat_template,
        model_config=loaded.model.config,
        model_name=plan.run_id,
    )


def _minibatches(plan: Plan) -> int | None:
    """Optimizer steps per epoch when a batch's rows vary in number (agent episodes: one row per
    stretch of conversation); None where every batch has the planned size."""
    env = plan.config.environment
    if env is None or not env.is_agent:
        return None
    rows = plan.derived.prompts_per_rank * plan.config.algorithm.num_generations
    return max(1, rows // plan.derived.minibatch_per_rank)


def _answer_budget(config: Any) -> int:
    """The most tokens the model writes in one sequence: every answer of an episode."""
    turns = config.environment.max_turns if config.environment is not None else 1
    return turns * config.generation.max_new_tokens


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


def _build_learner(
    ctx: WorkerContext,
    model: torch.nn.Module,
    pad_token_id: int,
    reference: torch.nn.Module | None,
    critic: Critic | None,
) -> Learner:
    plan = ctx.plan
    algo, derived = plan.config.algorithm, plan.derived
    head = critic.model.head if critic and critic.shares_policy else None
    optimizer = build_optimizer(
        model,
        algo,
        precision=derived.precision,
        extra=head,
        extra_lr=algo.critic_lr if head is not None else None,
    )
    # A KL that goes into the token rewards (_token_advantages) is not in the loss too.
    in_reward = derived.kl_in_reward
    return Learner(
        model,
        optimizer,
        build_scheduler(optimizer, algo, derived.total_optimizer_steps),
        LearnerKnobs(
            minibatch_size=derived.minibatch_per_rank,
            micro_batch_size=derived.micro_batch_size,
            update_epochs=algo.update_epochs,
            clip_ratio_low=algo.clip_ratio_low,
            clip_ratio_high=algo.clip_ratio_high,
            kl_coef=0.0 if in_reward else algo.kl_coef,
            kl_estimator=algo.kl_estimator,
            loss_aggregation=algo.loss_aggregation,
            max_grad_norm=algo.max_grad_norm,
            temperature=derived.logprob_temperature,
            max_new_tokens=_answer_budget(plan.config),
            autocast_dtype=autocast_dtype(derived.precision),
            minibatches=_minibatches(plan),
        ),
        pad_token_id=pad_token_id,
        device=ctx.device,
        reference=None if in_reward else reference,
        critic=critic,
    )


def _token_advantages(
    plan: Plan, kind: OnlineAlgorithm, learner: Learner, reference: torch.nn.Module | None
) -> TokenAdvantages | None:
    """The kind's per-token scorer (PPO, REINFORCE++), scoring with the learner's forward."""
    if kind.token_advantages is None:
        return None
    algo, in_reward = plan.config.algorithm, plan.derived.kl_in_reward
    scoring = Scoring(
        logprobs=learner.completion_logprobs,
        pad_token_id=learner.pad_token_id,
        device=learner.device,
        reference=reference if in_reward else None,
        kl_coef=algo.kl_coef,
        kl_in_reward=in_reward,
        critic=learner.critic,
    )
    return kind.token_advantages(algo, scoring)


def _inside_reward(ctx: WorkerContext) -> Callable[[str], Any]:
    """Notes, for the host, which reward plugin this worker is running (see runtime/activity)."""
    labels = {
        record.name: f"reward {record.name!r} (rewards[{i}]: {record.plugin.ref})"
        for i, record in enumerate(ctx.plan.rewards)
    }

    def guard(name: str) -> Any:
        if ctx.activity is None:
            return contextlib.nullcontext()
        return ctx.activity.inside(labels.get(name, f"reward {name!r}"))

    return guard


def _build_engine(ctx: WorkerContext, loaded, model: torch.nn.Module) -> Engine:
    plan, gen = ctx.plan, ctx.plan.config.generation
    vllm = gen.engine == "vllm"
    context = episode_tokens(gen.max_prompt_tokens, gen.max_new_tokens, plan.config.environment)
    if plan.config.environment is not None and plan.config.environment.is_agent:
        context = plan.model.context_length  # an agent's conversation grows as it likes
    directory = None
    if vllm:
        # vLLM loads a model directory of its own: the policy as loaded (GGUF dequantized,
        # overrides applied) is written once to the run directory, then synced after each step.
        directory = Path(plan.derived.run_dir) / "engine-model" / f"rank-{ctx.rank}"
        model.save_pretrained(directory)
        loaded.tokenizer.save_pretrained(directory)
    return build_engine(
        gen.engine,
        model=model,
        tokenizer=loaded.tokenizer,
        eos_token_ids=loaded.eos_token_ids,
        pad_token_id=loaded.pad_token_id,
        device=ctx.device,
        max_batch_size=gen.max_batch_size,
        # vLLM is seeded per rank when it starts; the hf engine's own stream is never drawn from
        # here (every rollout brings its seed, evaluation is greedy), so it stays unseeded.
        seed=derive_seed(plan.seeds.sampling, f"engine:{ctx.rank}") if vllm else None,
        model_dir=directory,
        dtype=plan.derived.dtype,
        gpu_memory_utilization=gen.gpu_memory_utilization,
        max_model_len=context,
        cuda_graphs=None if gen.cuda_graphs == "auto" else gen.cuda_graphs,
        max_context=context,
        plugin=load_engine_plugin(plan.engine),
    )


def _build_critic(model: torch.nn.Module, algo, derived: Any) -> Critic:
    separate = algo.critic == "separate"
    value_model = value_model_for(model, separate=separate)
    optimizer = scheduler = None
    if separate:
        optimizer = build_optimizer(
            value_model, algo, precision=derived.precision, lr=algo.critic_lr
        )
        scheduler = build_scheduler(optimizer, algo, derived.total_optimizer_steps)
    return Critic(
        model=value_model,
        optimizer=optimizer,
        scheduler=scheduler,
        vf_coef=algo.vf_coef,
        value_clip=algo.value_clip,
        max_grad_norm=algo.max_grad_norm,
    )
