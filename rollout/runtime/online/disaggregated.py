"""The online loop with actors and learners on processes of their own (a placement such as
{ actor = [0], learner = [1] }).

Actor ranks hold the engine and the rewards (and a multi-turn environment, with its sidecar and
episodic memory: rollout.runtime.online.carried_memory): they generate and score a batch per
step (or play its episodes) and send each learner its share of it, and play the held-out
evaluation of each due policy version (rollout.runtime.online.split_eval). One actor takes every prompt of a step; several share each step's
prompts through the work queue (rollout.runtime.online.shared_prompts), chunk by chunk. Learner
ranks hold the policy, its optimizer (and reference, critic): they train on the step's batch as
colocated ranks do, and after each step the first learner broadcasts the policy to every actor:
a snapshot of it, sent while the learner goes on to the next step (weight_sync.WeightPublisher).
perf/weight_sync_s is the wait for the previous broadcast plus the snapshot; perf/weight_broadcast_s
the previous broadcast's own duration, until the actors took it. With cluster.sharding = "fsdp"
the learners shard the policy over their own ranks, and gather it whole on the first learner for
each broadcast (the gather counts in perf/weight_sync_s).

With algorithm.max_staleness = k the actors run ahead: batch s is sampled with the weights of
version max(0, s - 1 - k), exactly (an actor waits for that version, and takes no newer one), so
a run is reproducible and every collective lines up. k = 0 is the synchronous loop, and gives
the colocated plan's numbers: actor i and learner i are seeded as colocated rank i.

Before checkpointing step s with k >= 1, the learners receive batches s+1..min(s+k, total)
(the actors sample them with versions up to s-1, so they never wait for the learners to go on)
and the checkpoint saves them (rollout.runtime.online.pending); the next steps take them from
there. A resumed run starts from the learners' checkpoint: the first learner sends its weights,
the step, and how many batches ahead of it the checkpoint held; each actor skips the prompts of
those steps too and samples on from step s+k+1, with version s, as an uninterrupted run does.
The resumed run trains on exactly the batches the uninterrupted one would.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from rollout.harness.memory import MEMORY_DIR
from rollout.runtime import transport, weight_sync
from rollout.runtime.context import WorkerContext
from rollout.runtime.online import carried_memory, shared_prompts, split_eval
from rollout.runtime.online import trainer as colocated
from rollout.runtime.online.algorithms import ALGORITHMS
from rollout.runtime.online.batches import RolloutBatch, concat, from_wire, to_wire
from rollout.runtime.online.carried_memory import CarriedMemory
from rollout.runtime.online.pending import BUFFER, PendingBatches, gather_shares, write_shares
from rollout.runtime.online.prompts import load_data
from rollout.runtime.online.staleness import StaleCorrection
from rollout.runtime.phases import PhaseClock
from rollout.runtime.recording import record_metrics, record_samples
from rollout.runtime.run_state import RunState
from rollout.runtime.sharding import shard_learner, whole_weights
from rollout.seeds import derive_seed
from rollout.storage.writer import BackgroundWriter

log = logging.getLogger("rollout.trainer")


def train_split(ctx: WorkerContext, writer: BackgroundWriter) -> None:
    torch.manual_seed(ctx.plan.seeds.per_rank[ctx.seed_index])
    groups = weight_sync.make_groups(ctx.role_ranks("actor"), ctx.role_ranks("learner"))
    if "learner" in ctx.roles:
        transport.train_among(groups.learner_group)
        _learn(ctx, writer, groups)
    else:
        _act(ctx, groups)


# --- the actor side ------------------------------------------------------------------------------


def _act(ctx: WorkerContext, groups: weight_sync.Groups) -> None:
    plan = ctx.plan
    kind = ALGORITHMS[plan.config.algorithm.kind]
    loaded, model, _ = colocated._load_policy(ctx)
    engine = colocated._build_engine(ctx, loaded, model)
    # The single-turn actor, or with [environment] the episode actor: the environment (and its
    # sidecar, if it has one) lives in this process, and stops with it.
    prompt_format = colocated._prompt_format(plan.config, loaded)
    actor = colocated._build_actor(ctx, engine, prompt_format, kind, loaded)
    evaluation = split_eval.ActorEvaluation(ctx, groups, actor, engine, prompt_format)
    try:
        _act_with(ctx, groups, actor, engine, model, evaluation)
    finally:
        close = getattr(actor, "close", None)
        if callable(close):
            close()


def _act_with(
    ctx: WorkerContext,
    groups: weight_sync.Groups,
    actor,
    engine,
    model: torch.nn.Module,
    evaluation: split_eval.ActorEvaluation,
) -> None:
    plan = ctx.plan
    index = groups.actors.index(ctx.rank)
    # One actor takes every prompt; several share each step's through the work queue.
    queued = len(groups.actors) > 1
    prompts = shared_prompts.SharedPrompts(ctx) if queued else Prompts(ctx, index)
    shares = _shares(ctx, groups, index)
    staleness = plan.config.algorithm.max_staleness
    total = plan.derived.total_steps

    in_flight: list[weight_sync.Sent] = []
    memory = getattr(actor, "memory", None)  # an environment's episodic memory, if it keeps one

    def take() -> dict[str, Any]:
        """The next weights; then, when that version is due, its evaluation (split_eval)."""
        header = _take_weights(groups, engine, model)
        if not header.get("stop"):
            carried_memory.restore(memory, header)  # the first carries the checkpoint's
            in_flight.extend(evaluation.after_loading(header["version"]))
        return header

    # The first sync: the learner's weights as it starts (resumed or not), the step it is at,
    # and how many batches after it the learners already hold (a checkpoint's pending batches).
    header = take()
    start = header["step"]
    first = start + header["ahead"] + 1
    prompts.skip(first - 1)
    log.info("actor %d generating steps %d..%d (max staleness %d)", index, first, total, staleness)
    for step in range(first, total + 1):
        if ctx.activity is not None:
            ctx.activity.at_step(step)
        # Batch `step` is sampled with version step - 1 - k exactly: deterministic staleness.
        # Resumed at s with its k batches ahead held, the first, s + k + 1, takes version s.
        waited, evaluated = time.perf_counter(), evaluation.seconds
        while engine.policy_version < max(start, step - 1 - staleness):
            header = take()
            if header.get("stop"):
                return
        wait_s = time.perf_counter() - waited - (evaluation.seconds - evaluated)
        in_flight[:] = [sent for sent in in_flight if not sent.done()]
        if memory is not None:
            memory.step = step  # what the environment writes now carries the step
        if queued:  # an environment with memory has one actor (the plan sees to it)
            in_flight += shared_prompts.act_on_step(
                ctx, groups, actor, step, start, prompts.take(), {"perf/actor_wait_s": wait_s}
            )
            continue
        rows = prompts.take()
        seed = derive_seed(plan.seeds.sampling, f"{step}:{index}")
        rollout = actor.rollout(rows, seed=seed)
        metrics = {**rollout.metrics, "perf/actor_wait_s": wait_s}
        limit = plan.config.logging.samples_per_step
        for learner, (lo, hi) in zip(groups.learners, shares, strict=True):
            share = rollout.batch.select(list(range(lo, hi)))
            if learner == groups.learners[0]:  # it records the first few of the step
                share.samples = rollout.samples[lo:hi][:limit]
                if memory is not None:  # and checkpoints the memory
                    share.actor_memory = memory.to_json()
            wire, tensors = to_wire(share)
            wire.update(step=step, metrics=metrics)
            in_flight.append(weight_sync.send_message(wire, tensors, learner))
    # The learners sync after every step: take the versions still owed, so the broadcasts match.
    while engine.policy_version < total and not header.get("stop"):
        header = take()
    for sent in in_flight:
        sent.wait()


def _take_weights(groups: weight_sync.Groups, engine, model: torch.nn.Module) -> dict[str, Any]:
    header, weights = weight_sync.receive_weights(groups, model.state_dict())
    if not header.get("stop"):
        engine.load_weights(weights, header["version"])
    return header


class Prompts:
    """Where a lone actor's prompts come from: every step's prompts, as colocated rank 0 of 1
    takes them (several actors share theirs through rollout.runtime.online.shared_prompts)."""

    def __init__(self, ctx: WorkerContext, index: int):
        self.per_step = ctx.plan.derived.prompts_per_rank
        actors = len(ctx.role_ranks("actor"))
        self.stream, _ = load_data(ctx, rank=index, world_size=actors)

    def skip(self, steps: int) -> None:
        """Pass over the prompts of `steps` steps already trained (a resumed run)."""
        if steps:
            self.stream.take(steps * self.per_step)

    def take(self) -> list[dict[str, Any]]:
        return [row.record for row in self.stream.take(self.per_step)]


def _shares(ctx: WorkerContext, groups: weight_sync.Groups, index: int) -> list[tuple[int, int]]:
    """For each learner, the rows [lo, hi) of this actor's batch that fall in its share of the
    step's batch (the actors' batches one after another, cut in equal parts per learner)."""
    plan = ctx.plan
    per_actor = plan.derived.prompts_per_rank * plan.config.algorithm.num_generations
    per_learner = per_actor * len(groups.actors) // len(groups.learners)
    first = index * per_actor
    shares = []
    for j in range(len(groups.learners)):
        lo = max(first, j * per_learner) - first
        hi = min(first + per_actor, (j + 1) * per_learner) - first
        shares.append((lo, max(lo, hi)))
    return shares


# --- the learner side ----------------------------------------------------------------------------


def _learn(ctx: WorkerContext, writer: BackgroundWriter, groups: weight_sync.Groups) -> None:
    plan, algo = ctx.plan, ctx.plan.config.algorithm
    kind = ALGORITHMS[algo.kind]
    loaded, model, adapters = colocated._load_policy(ctx)
    reference = None
    if plan.derived.keeps_reference_model:
        reference = colocated._frozen_copy(model)
    elif plan.derived.reference_adapters_off:
        assert adapters is not None
        reference = adapters.without_adapters()
    # Sharded (cluster.sharding = "fsdp") over the learners after the reference copied the
    # whole model (each learner keeps a whole frozen copy), before the optimizer takes it.
    model = shard_learner(ctx, model)
    critic = colocated._build_critic(model, algo, plan.derived) if kind.critic else None
    learner = colocated._build_learner(ctx, model, loaded.pad_token_id, reference, critic)
    token_advantages = colocated._token_advantages(plan, kind, learner, reference)
    checkpoints = RunState(
        plan.derived.artifacts,
        model,
        loaded.tokenizer,
        learner.optimizer,
        learner.scheduler,
        None,  # the actors hold the prompt streams
        colocated.extras_of(learner),
        adapters,
    )
    main = ctx.rank == groups.source
    start = 0
    pending = PendingBatches()  # batches received ahead of their step, saved with checkpoints
    read_pending = functools.partial(pending.read, index=ctx.seed_index)
    memory = CarriedMemory()  # the actor's episodic memory, saved with checkpoints
    resumed = checkpoints.resume(ctx, {BUFFER: read_pending, MEMORY_DIR: memory.read})
    if resumed is not None:
        start = resumed["step"]
        if pending.steps() != list(range(start + 1, start + 1 + len(pending))):
            raise RuntimeError(
                f"the checkpoint of step {start} holds pending batches of steps "
                f"{pending.steps()}, not the steps right after it"
            )
    # The first learner records the actors' evaluations of the due versions, in their order.
    evaluations = split_eval.LearnerEvaluation(ctx, writer, groups, start)
    receive = functools.partial(_receive_step, memory=memory, evaluations=evaluations)
    # The first learner broadcasts a snapshot of the weights without waiting for the actors to
    # take it, and waits for that broadcast only before its next one (or its stop, or its end).
    publisher = weight_sync.WeightPublisher(groups) if main else None
    weights = whole_weights(model)  # every learner takes part when the model is sharded
    if publisher is not None:
        first = {"version": start, "step": start, "ahead": len(pending), **memory.header()}
        publisher.publish(weights, first)
    total = plan.derived.total_steps
    log.info("training %s for steps %d..%d", algo.kind, start + 1, total)
    for step in range(start + 1, total + 1):
        if ctx.stop.is_set():
            log.warning("stop requested: checkpointing at step %d and exiting", step - 1)
            _checkpoint(ctx, writer, groups, checkpoints, pending, memory, receive, step - 1, start)
            if publisher is not None:
                publisher.stop({"version": step - 1, "step": step - 1})
            return
        if ctx.activity is not None:
            ctx.activity.at_step(step)
        started = time.perf_counter()
        clock = PhaseClock(ctx.device)
        with clock.phase("receive"):
            batch, actor_metrics = pending.take(step) or receive(ctx, groups, step, start)
        metrics = dict(actor_metrics)
        # The policy about to train is version step - 1; the batch was sampled by an older one.
        staleness = step - 1 - batch.policy_version
        metrics["train/staleness"] = float(staleness)
        if token_advantages is not None:
            with clock.phase("shape"):
                batch, shaping_metrics = token_advantages(batch)
            metrics.update(shaping_metrics)
        # A stale batch is corrected inside the loss, from the learner's own forward.
        stale = StaleCorrection(algo.stale_samples, algo.tis_bound) if staleness > 0 else None
        with clock.phase("learn"):
            metrics.update({f"train/{k}": v for k, v in learner.update(batch, stale).items()})
        # The sync: a sharded policy's gather, the wait for the previous broadcast, the snapshot.
        with clock.phase("sync"):
            weights = whole_weights(model)
            if publisher is not None:
                publisher.publish(weights, {"version": step, "step": step})
                if publisher.broadcast_s is not None:  # the previous step's, now complete
                    metrics["perf/weight_broadcast_s"] = publisher.broadcast_s
        elapsed = time.perf_counter() - started
        metrics.update(clock.metrics())
        metrics["perf/weight_sync_s"] = clock.seconds.get("sync", 0.0)
        metrics["perf/learner_wait_s"] = clock.seconds["receive"]
        metrics["perf/train_s"] = sum(
            clock.seconds[name] for name in ("shape", "learn", "sync") if name in clock.seconds
        )
        metrics["perf/step_s"] = elapsed
        completions = len(batch) * len(groups.learners)
        metrics["perf/completions_per_s"] = completions / elapsed
        tokens = metrics["perf/generated_tokens"] * len(groups.actors)
        metrics["perf/tokens_per_s"] = tokens / elapsed
        record_metrics(ctx, writer, step, metrics)
        record_samples(ctx, writer, step, batch.samples)
        if step == total or step % plan.config.checkpoint.interval == 0:
            _checkpoint(ctx, writer, groups, checkpoints, pending, memory, receive, step, start)
    if publisher is not None:
        publisher.wait()  # the last broadcast, before the process group goes
    evaluations.take_through(total)  # those of the last versions, after the last batch


def _checkpoint(
    ctx: WorkerContext,
    writer: BackgroundWriter,
    groups: weight_sync.Groups,
    checkpoints: RunState,
    pending: PendingBatches,
    memory: CarriedMemory,
    receive: Callable[..., tuple[RolloutBatch, dict[str, float]]],
    step: int,
    start: int,
) -> None:
    """Checkpoint `step` (every learner calls it) with the batches of the next k steps
    (max_staleness), received now where not held yet: they were sampled with weights older
    than the checkpoint's, so a resumed run must train on these, not sample them again.

    The actors sample batch t with version max(0, t - 1 - k), so batches up to step + k need
    versions up to step - 1, which the learners have broadcast: receiving them never waits on
    the learners' own progress (with several actors, on the work queue's either)."""
    last = min(step + ctx.plan.config.algorithm.max_staleness, ctx.plan.derived.total_steps)
    if step > 0:  # a checkpoint of step 0 is not written
        for ahead in range(step + 1, last + 1):
            if ahead not in pending:
                pending.put(ahead, *receive(ctx, groups, ahead, start))
    loop_files: dict[str, Any] = {}
    if len(pending):  # as many on every learner: they receive the same steps
        shares = gather_shares(ctx, pending)
        loop_files[BUFFER] = functools.partial(write_shares, shares=shares)
    if memory.state is not None:  # the actor's after batch `last`, where a resumed one goes on
        loop_files[MEMORY_DIR] = memory.write
    checkpoints.save(ctx, writer, step, {"policy_version": step}, loop_files)


def _receive_step(
    ctx: WorkerContext,
    groups: weight_sync.Groups,
    step: int,
    start: int,
    memory: CarriedMemory,
    evaluations: split_eval.LearnerEvaluation,
) -> tuple[RolloutBatch, dict[str, float]]:
    """This learner's share of batch `step` and the step's actor metrics: from the lone actor,
    or from the actors sharing the step's prompts through the work queue. Before it, the
    evaluations the actors sent first (of the versions they loaded to sample it); the actor's
    memory the batch carries (if any) is now the newest."""
    staleness = ctx.plan.config.algorithm.max_staleness
    evaluations.take_through(max(start, step - 1 - staleness))
    if len(groups.actors) > 1:
        batch, metrics = shared_prompts.receive_step(ctx, groups, step, start)
    else:
        batch, metrics = _receive(groups, step)
    memory.take(batch)
    return batch, metrics


def _receive(groups: weight_sync.Groups, step: int) -> tuple[RolloutBatch, dict[str, float]]:
    """This learner's share of batch `step`, from every actor in order, and the actors' rollout
    metrics averaged over them (each sampled an equal share)."""
    parts, sums = [], {}
    for actor in groups.actors:
        header, tensors = weight_sync.recv_message(actor)
        if header["step"] != step:
            raise RuntimeError(f"expected batch {step} from rank {actor}, got {header['step']}")
        for name, value in header["metrics"].items():
            sums[name] = sums.get(name, 0.0) + value
        if header["completion_lengths"]:
            parts.append(from_wire(header, tensors))
    metrics = {name: total / len(groups.actors) for name, total in sums.items()}
    return concat(parts), metrics
