"""Several actor processes sharing each step's prompts through the work queue
(rollout/runtime/work_queue.py), for a disaggregated run with two actor ranks or more.

Every actor reads the whole step's prompt list from the seeded stream, alike. The step's queue
hands them out in chunks of `plan.derived.queue_chunk_size` prompts: an actor claims a chunk,
generates and scores it (rewards per chunk, as chunks finish), completes it in the queue and
sends its rows to the learners. A fast actor simply claims more chunks (work stealing).

- Sampling seeds follow the chunk (step, chunk index), not the actor that ran it, and each
  learner assembles its rows in item order: a step's batch, and so the run, is the same
  whichever actor did which chunk.
- An actor completes a chunk *before* sending its tensors, and sends them only if its completion
  counted: the losing copy of a chunk done twice (a lease that expired on a live, slow actor)
  is dropped and never sent, so no send waits forever for a receive that will not come.
- Each item's result in the queue says which rank holds the chunk's tensors, in which order
  that rank sent them (`seq`), the chunk's row count and the prompt. The first learner collects
  the step (in item order) and passes the results to the other learners; every learner then
  takes each chunk's message from its holder, by tag (step, chunk). Each actor's messages are
  taken in the order it sent them, which NCCL (it ignores tags) needs as much as gloo's tags.
- Every learner gets a message for every chunk (its rows of the chunk, possibly none, and the
  chunk's rollout metrics), and one summary per actor per step (its queue metrics), so every
  learner computes the same step metrics.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rollout.runtime import transport, weight_sync
from rollout.runtime.data import Row
from rollout.runtime.online.batches import RolloutBatch, concat, from_wire, to_wire
from rollout.runtime.online.prompts import load_data
from rollout.runtime.work_queue import WorkQueue
from rollout.seeds import derive_seed

if TYPE_CHECKING:
    from rollout.runtime.context import WorkerContext
    from rollout.runtime.online.actor import Actor

log = logging.getLogger("rollout.trainer")

LEASE_S = 60.0
"""A chunk whose holder's heartbeat stopped this long is generated again by another actor. An
actor that dies ends the whole run today (torchrun stops every rank), so this only matters for a
live actor whose heartbeat thread stalled longer than this: its chunk is then done twice."""

COLLECT_TIMEOUT_S = 24 * 3600.0
"""How long the first learner waits for a step's chunks. A dead actor stops the run long before
(torchrun); this bounds only a hang, which then names the missing chunks and their holders."""

POLL_S = 0.01
"""How often an actor with nothing left to claim, and the collector, look at the store: the
last chunk's completion reaches the learner within this (a local TCPStore answers in ~1 ms)."""

_SUMMARY_SLOT = 0xFFFF
"""The tag slot of an actor's end-of-step summary; chunks use slots 0 .. 0xFFFE."""


def message_tag(step: int, slot: int) -> int:
    """The point-to-point tag of chunk `slot` of `step` (or of a step's summary). Gloo tags are
    non-negative 32-bit ints: steps wrap at 16384, far more than the steps in flight at once
    (max_staleness + 1), so two messages in flight between two ranks never share a tag."""
    return (step % 16384) << 16 | (slot if slot == _SUMMARY_SLOT else slot % _SUMMARY_SLOT)


def queue_namespace(start: int) -> str:
    """Keys of the run's queues: one namespace per start (a resumed world numbers its steps on
    from `start`, and must not meet the consumed-through mark a former world left behind)."""
    return f"work_queue/from-{start}"


def step_queue(ctx: WorkerContext, step: int, start: int) -> WorkQueue:
    derived = ctx.plan.derived
    assert derived.prompts_per_step is not None and derived.queue_chunk_size is not None
    return WorkQueue(
        transport.process_group_store(),
        step,
        num_items=derived.prompts_per_step,
        chunk_size=derived.queue_chunk_size,
        lease_s=LEASE_S,
        poll_s=POLL_S,
        namespace=queue_namespace(start),
    )


def learner_shares(rows_per_step: int, learners: int) -> list[tuple[int, int]]:
    """Rows [lo, hi) of a step's batch (item order) that each learner trains on."""
    per = rows_per_step // learners
    return [(j * per, (j + 1) * per) for j in range(learners)]


# --- the actor's side ----------------------------------------------------------------------------


class SharedPrompts:
    """Every step's whole prompt list (the stream undealt: what colocated ranks 0..n-1 would
    take between them), read alike by every actor."""

    def __init__(self, ctx: WorkerContext):
        self.per_step = ctx.plan.derived.prompts_per_step
        self.stream, _ = load_data(ctx, rank=0, world_size=1)

    def skip(self, steps: int) -> None:
        if steps:
            self.stream.take(steps * self.per_step)

    def take(self) -> list[Row]:
        return self.stream.take(self.per_step)


def act_on_step(
    ctx: WorkerContext,
    groups: weight_sync.Groups,
    actor: Actor,
    step: int,
    start: int,
    rows: Sequence[Row],
    extra: dict[str, float],
) -> list[weight_sync.Sent]:
    """Claim, generate, score, complete and send chunks of `step` until the step's queue is
    done; then send every learner this actor's summary (queue metrics and `extra`)."""
    plan = ctx.plan
    group = plan.config.algorithm.num_generations
    samples_per_step = plan.config.logging.samples_per_step
    shares = learner_shares(len(rows) * group, len(groups.learners))
    queue = step_queue(ctx, step, start)
    index = groups.actors.index(ctx.rank)
    sends: list[weight_sync.Sent] = []
    sent = 0
    with queue.actor(f"actor-{index}") as claims:
        while (chunk := claims.claim()) is not None:
            part = [rows[i] for i in chunk.items]
            # The chunk's seed, whoever runs it: results do not depend on the scheduling.
            seed = derive_seed(plan.seeds.sampling, f"{step}:chunk:{chunk.index}")
            rollout = actor.rollout([row.record for row in part], seed=seed)
            batch = rollout.batch
            if len(batch) != len(part) * group:
                raise RuntimeError(
                    f"chunk {chunk.index} of step {step}: {len(batch)} completions for "
                    f"{len(part)} prompts, not {group} each"
                )
            results = [
                {"rank": ctx.rank, "seq": sent, "rows": len(batch), "prompt": _prompt_id(row)}
                for row in part
            ]
            if not claims.complete(chunk, results):
                continue  # another holder's copy counted: this one is never sent
            first = chunk.items.start * group
            for learner, (lo, hi) in zip(groups.learners, shares, strict=True):
                mine = [row - first for row in range(max(lo, first), min(hi, first + len(batch)))]
                share = batch.select(mine)  # may be empty
                if learner == groups.learners[0]:  # it records the first few of the step
                    share.samples = [rollout.samples[row] for row in mine][:samples_per_step]
                wire, tensors = to_wire(share)
                wire.update(step=step, chunk=chunk.index, metrics=rollout.metrics)
                sends.append(
                    weight_sync.send_message(wire, tensors, learner, message_tag(step, chunk.index))
                )
            sent += 1
    summary = {"step": step, "actor": index, "queue": claims.metrics.as_dict(), **extra}
    for learner in groups.learners:
        sends.append(
            weight_sync.send_message(summary, [], learner, message_tag(step, _SUMMARY_SLOT))
        )
    return sends


def _prompt_id(row: Row) -> str:
    return f"{row.epoch}:{row.index}"


# --- the learner's side --------------------------------------------------------------------------


def receive_step(
    ctx: WorkerContext, groups: weight_sync.Groups, step: int, start: int
) -> tuple[RolloutBatch, dict[str, float]]:
    """This learner's rows of batch `step` in item order, and the step's metrics: the chunks'
    rollout metrics pooled over every chunk, and the actors' queue metrics."""
    results = None
    if ctx.rank == groups.source:
        # The step stays unreleased until the next one is collected: an actor whose completion
        # raced this collect (read here, but the actor not yet past its own check) must not find
        # the step released, or it would take its completion for a late duplicate and never send
        # the rows this learner is about to wait for. By the next collect every learner has
        # taken this step's rows, so a completion that finds it released then is a duplicate.
        results = step_queue(ctx, step, start).collect(COLLECT_TIMEOUT_S, release=False)
        step_queue(ctx, step - 1, start).release()
    if len(groups.learners) > 1:  # the other learners take the first one's (collective)
        results = transport.gather_state(results)[0]
    assert results is not None
    chunk_size = ctx.plan.derived.queue_chunk_size
    chunks = [results[i] for i in range(0, len(results), chunk_size)]
    log.debug("step %d prompts %s", step, ",".join(result["prompt"] for result in results))

    parts: dict[int, RolloutBatch] = {}
    chunk_metrics: dict[int, tuple[int, dict[str, float]]] = {}
    summaries = []
    for actor in groups.actors:
        # This actor's chunks in the order it sent them, then its summary.
        held = sorted((c["seq"], i) for i, c in enumerate(chunks) if c["rank"] == actor)
        for _, index in held:
            header, tensors = weight_sync.recv_message(actor, message_tag(step, index))
            if (header["step"], header["chunk"]) != (step, index):
                raise RuntimeError(
                    f"expected chunk {index} of step {step} from rank {actor}, got chunk "
                    f"{header['chunk']} of step {header['step']}"
                )
            chunk_metrics[index] = (chunks[index]["rows"], header["metrics"])
            if header["completion_lengths"]:
                parts[index] = from_wire(header, tensors)
        summary, _ = weight_sync.recv_message(actor, message_tag(step, _SUMMARY_SLOT))
        summaries.append(summary)
    batch = concat([parts[index] for index in sorted(parts)])
    metrics = pool_chunk_metrics([chunk_metrics[i] for i in range(len(chunks))], len(summaries))
    metrics.update(queue_metrics(summaries))
    return batch, metrics


# Seconds and tokens add up over chunks; per actor (as one actor's rollout would report them)
# they are the sum over the actors divided by their number.
_PER_ACTOR_SUMS = ("perf/generate_s", "perf/score_s", "perf/generated_tokens")


def pool_chunk_metrics(
    chunks: Sequence[tuple[int, dict[str, float]]], actors: int
) -> dict[str, float]:
    """The step's rollout metrics from its chunks' ((rows, metrics), in chunk order): means
    weighted by rows, reward/std pooled over every row, time and tokens per actor."""
    total = sum(rows for rows, _ in chunks)
    names = sorted(set.intersection(*(set(metrics) for _, metrics in chunks)))
    pooled = {}
    for name in names:
        if name in _PER_ACTOR_SUMS:
            pooled[name] = sum(metrics[name] for _, metrics in chunks) / actors
        elif name != "reward/std":
            pooled[name] = sum(rows * metrics[name] for rows, metrics in chunks) / total
    if "reward/mean" in pooled and "reward/std" in names:
        # Each chunk's (n - 1) s^2 + n m^2 is its sum of squares: pool them, then the std.
        mean = pooled["reward/mean"]
        squares = sum(
            (rows - 1) * metrics["reward/std"] ** 2 + rows * metrics["reward/mean"] ** 2
            for rows, metrics in chunks
        )
        variance = (squares - total * mean**2) / (total - 1) if total > 1 else 0.0
        pooled["reward/std"] = math.sqrt(max(0.0, variance))
    return pooled


def queue_metrics(summaries: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per actor: the chunks it claimed and its seconds waiting on the queue; over the actors:
    chunks taken over from an expired lease, completions that lost, and the wait for weights."""
    metrics: dict[str, float] = {}
    for summary in summaries:
        queue, actor = summary["queue"], summary["actor"]
        metrics[f"queue/chunks_claimed/actor_{actor}"] = queue["queue/chunks_claimed"]
        metrics[f"queue/wait_s/actor_{actor}"] = queue["queue/wait_s"]
    for name in ("queue/chunks_requeued", "queue/completions_ignored"):
        metrics[name] = sum(summary["queue"][name] for summary in summaries)
    metrics["perf/actor_wait_s"] = sum(s["perf/actor_wait_s"] for s in summaries) / len(summaries)
    return metrics
