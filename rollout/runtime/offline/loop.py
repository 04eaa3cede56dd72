"""The offline loop (DPO, IPO, KTO, SFT, reward models): batches of a fixed dataset, step by step.

It reads top to bottom: load the model and tokenize the data, get the reference log-probs (cached
in the run directory, or a live reference model), resume from the latest complete checkpoint
(rollout.runtime.run_state, as the online loop does), then one optimizer step per batch. Records are dealt as the online loop deals prompts
(rollout.runtime.data.PromptStream: seeded shuffles, epoch after epoch), so the checkpointed cursor
resumes without repeating or skipping a batch. What is specific to an objective lives in
rollout.runtime.offline.objectives and its maths in rollout.algorithms.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollout.harness.model_reward import SAMPLE_FORMAT_KEY
from rollout.models.loading import LoadedModel, load_model
from rollout.models.lora import Adapters, add_adapters
from rollout.runtime import transport
from rollout.runtime.components import build_optimizer, build_scheduler
from rollout.runtime.context import WorkerContext
from rollout.runtime.data import PromptStream
from rollout.runtime.offline.data import Split, load_splits
from rollout.runtime.offline.objectives import OBJECTIVES, Context, Objective, build_reward_model
from rollout.runtime.offline.reference import build_reference
from rollout.runtime.precision import autocast, autocast_dtype
from rollout.runtime.recording import record_metrics
from rollout.runtime.run_state import RunState
from rollout.runtime.sharding import shard_learner
from rollout.seeds import derive_seed
from rollout.storage.writer import BackgroundWriter
from rollout.tracing import span

log = logging.getLogger("rollout.offline")


@dataclass
class Run:
    """Everything the loop works with."""

    model: Any
    tokenizer: Any
    objective: Objective
    train: Split
    eval: Split | None
    stream: PromptStream
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    adapters: Adapters | None = None
    """With LoRA: the adapters, the only parameters the optimizer steps."""


def train(ctx: WorkerContext, writer: BackgroundWriter) -> None:
    plan, config = ctx.plan, ctx.plan.config
    run = _build(ctx)
    checkpoints = RunState(
        plan.derived.artifacts,
        run.model,
        run.tokenizer,
        run.optimizer,
        run.scheduler,
        run.stream,
        adapters=run.adapters,
    )
    per_rank = plan.derived.minibatch_per_rank

    start = 0
    resumed = checkpoints.resume(ctx)
    if resumed is not None:
        start = resumed["step"]
    elif run.eval is not None:
        record_metrics(ctx, writer, 0, _evaluate(ctx, run))

    total = plan.derived.total_steps
    log.info("training %s for steps %d..%d", config.algorithm.kind, start + 1, total)
    for step in range(start + 1, total + 1):
        if ctx.stop.is_set():
            log.warning("stop requested: checkpointing at step %d and exiting", step - 1)
            checkpoints.save(ctx, writer, step - 1)
            return
        started = time.perf_counter()
        if ctx.activity is not None:
            ctx.activity.at_step(step)
        rows = run.stream.take(per_rank)
        log.debug("step %d samples %s", step, ",".join(f"{r.epoch}:{r.index}" for r in rows))
        with span("learn"):  # the online loops' name for the update (PhaseClock's phase)
            metrics, tokens = _optimizer_step(ctx, run, [r.index for r in rows])
        elapsed = time.perf_counter() - started
        metrics["perf/step_s"] = elapsed
        metrics["perf/samples_per_s"] = per_rank * ctx.world_size / elapsed
        metrics["perf/tokens_per_s"] = tokens * ctx.world_size / elapsed
        record_metrics(ctx, writer, step, metrics)

        last = step == total
        interval = config.run.eval_interval
        if run.eval is not None and (last or (interval and step % interval == 0)):
            record_metrics(ctx, writer, step, _evaluate(ctx, run))
        if last or step % config.checkpoint.interval == 0:
            checkpoints.save(ctx, writer, step)


def _optimizer_step(ctx: WorkerContext, run: Run, indices: list[int]) -> tuple[dict, int]:
    """One optimizer step over this rank's records; the metrics summed over micro batches."""
    run.model.train()
    run.optimizer.zero_grad(set_to_none=True)
    forward = autocast(ctx.device, autocast_dtype(ctx.plan.derived.precision))
    with forward:
        step = run.objective.step_batches(
            run.model, run.train, indices, ctx.plan.derived.micro_batch_size
        )
    totals: dict[str, float] = defaultdict(float)
    tokens = step.tokens
    for micro in step.micros:
        with forward:
            loss, metrics, micro_tokens = run.objective.loss(run.model, run.train, micro)
        loss.backward()
        tokens += micro_tokens
        for name, value in metrics.items():
            totals[f"train/{name}"] += value
    # What the optimizer steps (with LoRA, the adapters alone): every rank averages the same.
    trained = [p for group in run.optimizer.param_groups for p in group["params"]]
    transport.average_gradients(trained)
    limit = ctx.plan.config.algorithm.max_grad_norm
    params = [p for p in trained if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, limit if limit is not None else float("inf"))
    run.optimizer.step()
    run.scheduler.step()
    totals["train/grad_norm"] = float(norm)  # read after the step is queued, not before it
    totals["train/lr"] = run.scheduler.get_last_lr()[0]
    return dict(totals), tokens


def _evaluate(ctx: WorkerContext, run: Run) -> dict[str, float]:
    """Metrics on the held-out split (each rank evaluates all of it: the split is small)."""
    assert run.eval is not None
    run.model.eval()
    started = time.perf_counter()
    with autocast(ctx.device, autocast_dtype(ctx.plan.derived.precision)):
        metrics = run.objective.evaluate(run.model, run.eval, ctx.plan.derived.micro_batch_size)
    log.info(
        "eval: %s (%.1f s)",
        ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())),
        time.perf_counter() - started,
    )
    return {f"eval/{name}": value for name, value in metrics.items()}


# --- building ------------------------------------------------------------------------------------


def _build(ctx: WorkerContext) -> Run:
    plan, config = ctx.plan, ctx.plan.config
    algo = config.algorithm
    # The same seed on every rank: a fresh reward head must be identical everywhere.
    torch.manual_seed(derive_seed(plan.seeds.root, "model"))
    loaded = load_model(
        plan.model,
        config.model,
        dtype=plan.derived.dtype,
        device=ctx.device,
        base_dir=Path(plan.base_dir),
    )
    model = _trainable(algo.kind, loaded, config)
    adapters = None
    if config.model.lora is not None:  # rm is refused with LoRA: its head would not train
        adapters = add_adapters(model, config.model.lora)
    if config.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    torch.manual_seed(plan.seeds.per_rank[ctx.rank])
    train_split, eval_split = load_splits(plan, loaded)
    log.info(
        "%d train and %d eval records tokenized",
        len(train_split),
        len(eval_split) if eval_split is not None else 0,
    )
    context = Context(
        pad_id=loaded.pad_token_id,
        device=ctx.device,
        algo=algo,
        max_length=algo.max_length,
    )
    objective = OBJECTIVES[algo.kind](context)
    if objective.streams:
        # Before any checkpoint is loaded: the reference is the model as the run began.
        context.reference = build_reference(
            ctx, model, objective, train_split, eval_split, adapters
        )
    # Sharded after the reference copied the model, before the optimizer takes its parameters.
    model = shard_learner(ctx, model)
    optimizer = build_optimizer(model, algo, precision=plan.derived.precision)
    return Run(
        model=model,
        tokenizer=loaded.tokenizer,
        objective=objective,
        train=train_split,
        eval=eval_split,
        stream=PromptStream(
            train_split.samples,
            seed=plan.seeds.data,
            shuffle=config.data.shuffle,
            rank=ctx.rank,
            world_size=ctx.world_size,
        ),
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, algo, plan.derived.total_optimizer_steps),
        adapters=adapters,
    )


def _trainable(kind: str, loaded: LoadedModel, config: Any) -> Any:
    model = loaded.model
    if kind == "rm":
        model = build_reward_model(model, loaded.pad_token_id)
        # How samples were formatted, for scoring with this model later (rewards = [{model}]).
        setattr(
            model.config,
            SAMPLE_FORMAT_KEY,
            {
                "use_chat_template": config.data.use_chat_template,
                "system_prompt": config.data.system_prompt,
                "eos_token_id": loaded.eos_token_ids[0],
            },
        )
    return model
