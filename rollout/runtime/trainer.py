"""The online RL loop (GRPO, RLOO): generate, score, update, sync, record, checkpoint.

It reads top to bottom: build the roles from the plan, resume from the latest complete
checkpoint, then one iteration per step. Algorithm maths lives in rollout/algorithms; this file
only moves data between the roles.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from rollout.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rollout.engines.base import SamplingParams
from rollout.engines.hf import HfEngine
from rollout.harness.reward_runner import RewardRunner
from rollout.plan.builder import derive_seed
from rollout.runtime.actor import Actor, PromptFormat
from rollout.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from rollout.runtime.components import (
    build_optimizer,
    build_reward_functions,
    build_scheduler,
    load_data,
)
from rollout.runtime.evaluate import evaluate
from rollout.runtime.learner import Learner, LearnerKnobs
from rollout.runtime.models import apply_chat_template, load_model
from rollout.runtime.transport import all_gather_json
from rollout.runtime.worker import WorkerContext
from rollout.storage.writer import BackgroundWriter

log = logging.getLogger("rollout.trainer")


@dataclass
class Roles:
    actor: Actor
    learner: Learner
    engine: HfEngine
    tokenizer: object
    prompt_format: PromptFormat


def train(ctx: WorkerContext, writer: BackgroundWriter) -> None:
    plan, config = ctx.plan, ctx.plan.config
    algo = config.algorithm
    torch.manual_seed(plan.seeds.per_rank[ctx.rank])
    roles = _build_roles(ctx)
    stream, eval_rows = load_data(ctx)
    checkpoints = Path(plan.derived.artifacts)
    prompts_per_rank = plan.derived.prompts_per_step // ctx.world_size

    start = 0
    latest = latest_checkpoint(checkpoints)
    if latest is not None:
        state = load_checkpoint(
            latest,
            model=roles.learner.model,
            optimizer=roles.learner.optimizer,
            scheduler=roles.learner.scheduler,
        )
        start = state["step"]
        stream.load_state_dict(state["cursor"][str(ctx.rank)])
        roles.engine.load_weights(None, version=state["policy_version"])
        log.info("resumed from %s at step %d", latest, start)
    elif eval_rows:
        _record(
            ctx,
            writer,
            0,
            evaluate(
                roles.engine, roles.prompt_format, roles.actor.rewards, eval_rows, config.generation
            ),
        )

    log.info("training %s for steps %d..%d", algo.kind, start + 1, plan.derived.total_steps)
    for step in range(start + 1, plan.derived.total_steps + 1):
        if ctx.stop.is_set():
            log.warning("stop requested: checkpointing at step %d and exiting", step - 1)
            _checkpoint(ctx, roles, stream, checkpoints, step - 1, writer)
            return
        started = time.perf_counter()
        rows = stream.take(prompts_per_rank)
        log.debug("step %d prompts %s", step, ",".join(f"{r.epoch}:{r.index}" for r in rows))
        seed = derive_seed(plan.seeds.sampling, f"{step}:{ctx.rank}")
        rollout = roles.actor.rollout([r.record for r in rows], seed=seed)
        learn_started = time.perf_counter()
        metrics = dict(rollout.metrics)
        metrics.update({f"train/{k}": v for k, v in roles.learner.update(rollout.batch).items()})
        roles.engine.load_weights(None, version=step)  # colocated: the engine shares the module
        elapsed = time.perf_counter() - started
        metrics["perf/train_s"] = time.perf_counter() - learn_started
        metrics["perf/step_s"] = elapsed
        metrics["perf/completions_per_s"] = len(rollout.batch) * ctx.world_size / elapsed
        metrics["perf/tokens_per_s"] = metrics["perf/generated_tokens"] * ctx.world_size / elapsed
        _record(ctx, writer, step, metrics)

        last = step == plan.derived.total_steps
        if eval_rows and (
            last or (config.run.eval_interval and step % config.run.eval_interval == 0)
        ):
            _record(
                ctx,
                writer,
                step,
                evaluate(
                    roles.engine,
                    roles.prompt_format,
                    roles.actor.rewards,
                    eval_rows,
                    config.generation,
                ),
            )
        if last or step % config.checkpoint.interval == 0:
            _checkpoint(ctx, roles, stream, checkpoints, step, writer)


def _build_roles(ctx: WorkerContext) -> Roles:
    plan, config = ctx.plan, ctx.plan.config
    algo, gen = config.algorithm, config.generation
    loaded = load_model(
        plan.model,
        config.model,
        dtype=plan.derived.dtype,
        device=ctx.device,
        base_dir=Path(plan.base_dir),
    )
    model = loaded.model.to(ctx.device)
    if config.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    engine = HfEngine(
        model,
        eos_token_ids=loaded.eos_token_ids,
        pad_token_id=loaded.pad_token_id,
        tokenizer=loaded.tokenizer,
        max_batch_size=gen.max_batch_size,
        device=ctx.device,
    )
    fields = config.data.fields.model_dump()

    def encode(text: str) -> list[int]:
        if config.data.use_chat_template:
            return apply_chat_template(
                loaded.tokenizer, loaded.chat_template, text, config.data.system_prompt
            )
        return loaded.tokenizer.encode(text, add_special_tokens=True)

    prompt_format = PromptFormat(
        encode=encode,
        prompt_field=fields["prompt"],
        role_fields={role: field for role, field in fields.items() if field},
    )
    knobs = {"scale": algo.scale_rewards} if algo.kind == "grpo" else {}
    actor = Actor(
        engine,
        prompt_format,
        RewardRunner(build_reward_functions(plan)),
        partial(ADVANTAGE_ESTIMATORS[algo.kind], **knobs),
        SamplingParams(
            max_new_tokens=gen.max_new_tokens,
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=gen.top_k,
            stop=tuple(gen.stop),
            n=algo.num_generations,
        ),
    )
    reference = None
    if algo.kl_coef > 0:
        # The reference is the policy as it starts: copied before any checkpoint is loaded.
        reference = copy.deepcopy(model).eval()
        reference.requires_grad_(False)
    optimizer = build_optimizer(model, algo)
    learner = Learner(
        model,
        optimizer,
        build_scheduler(
            optimizer, algo, plan.derived.total_steps * plan.derived.optimizer_steps_per_step
        ),
        LearnerKnobs(
            minibatch_size=plan.derived.minibatch_size // ctx.world_size,
            micro_batch_size=plan.derived.micro_batch_size,
            update_epochs=algo.update_epochs,
            clip_ratio_low=algo.clip_ratio_low,
            clip_ratio_high=algo.clip_ratio_high,
            kl_coef=algo.kl_coef,
            kl_estimator=algo.kl_estimator,
            loss_aggregation=algo.loss_aggregation,
            max_grad_norm=algo.max_grad_norm,
            temperature=gen.temperature if gen.temperature > 0 else 1.0,
            max_new_tokens=gen.max_new_tokens,
        ),
        pad_token_id=loaded.pad_token_id,
        device=ctx.device,
        reference=reference,
    )
    return Roles(
        actor=actor,
        learner=learner,
        engine=engine,
        tokenizer=loaded.tokenizer,
        prompt_format=prompt_format,
    )


def _record(
    ctx: WorkerContext, writer: BackgroundWriter, step: int, metrics: Mapping[str, float]
) -> None:
    """Average metrics over ranks; rank 0 writes them (off the hot path, via the writer)."""
    values = dict(metrics)
    if ctx.world_size > 1:
        names = sorted(values)
        stacked = torch.tensor([values[n] for n in names], dtype=torch.float64)
        dist.all_reduce(stacked)
        values = dict(zip(names, (stacked / ctx.world_size).tolist(), strict=True))
    if ctx.is_main:
        writer.write_metrics(ctx.plan.run_id, step, values)


def _checkpoint(
    ctx: WorkerContext, roles: Roles, stream, root: Path, step: int, writer: BackgroundWriter
) -> None:
    """Rank 0 saves (ranks hold identical weights); every rank's data cursor goes with it."""
    # Everything recorded up to this step reaches the store before the checkpoint exists, so a
    # crash after it loses no metric or log line of the steps it covers.
    writer.flush()
    cursors = _gather_cursors(ctx, stream.state_dict())
    if ctx.is_main and step > 0:
        path = save_checkpoint(
            root,
            step,
            model=roles.learner.model,
            tokenizer=roles.tokenizer,
            optimizer=roles.learner.optimizer,
            scheduler=roles.learner.scheduler,
            trainer_state={
                "step": step,
                "cursor": cursors,
                "policy_version": roles.engine.policy_version,
            },
            keep_last=ctx.plan.config.checkpoint.keep_last,
        )
        writer.write_checkpoint(ctx.plan.run_id, step, str(path))
        log.info("checkpoint %s", path)
    if ctx.world_size > 1:
        dist.barrier()


def _gather_cursors(ctx: WorkerContext, cursor: dict) -> dict[str, dict]:
    if ctx.world_size == 1:
        return {"0": cursor}
    return {str(rank): c for rank, c in enumerate(all_gather_json(cursor))}
