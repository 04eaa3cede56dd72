"""What every training loop reports across ranks, written by rank 0 (through the background
writer, off the hot path): step metrics averaged over ranks, evaluation means over every rank's
samples, and per-rank state gathered for a checkpoint.

`logging.interval` thins the training steps' rows only: a step is recorded every `interval`
steps, and always when it is the last step, an evaluation step or a checkpoint step, so the
metrics of every checkpoint and of the run's end are there. Evaluation means are always recorded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from rollout.runtime import transport
from rollout.storage.base import SampleRecord

progress = logging.getLogger("rollout.progress")

if TYPE_CHECKING:
    from rollout.planner.definition import Plan
    from rollout.runtime.context import WorkerContext
    from rollout.runtime.online.actor import Sample
    from rollout.storage.writer import BackgroundWriter


def record_metrics(
    ctx: WorkerContext, writer: BackgroundWriter, step: int, metrics: Mapping[str, float]
) -> None:
    """Average metrics over the learner ranks (each rank's are over equal shares of the step;
    colocated, every rank is one); the first writes them when `step` is recorded
    (`records_step`)."""
    values = dict(metrics)
    # Reduced on every step, recorded or not: rank 0 alone also records the step a stop will
    # checkpoint, and a collective that only some ranks enter would hang.
    if ctx.learners > 1:
        # Ranks may hold different names (one whose every row was skipped has no loss
        # statistics), and a sum of unequal lengths aborts gloo: agree on the names first, and
        # average each over the ranks that have it.
        names = sorted({name for held in transport.gather_state(sorted(values)) for name in held})
        held = [float(name in values) for name in names]
        totals = transport.sum_metrics([values.get(name, 0.0) for name in names] + held)
        sums, counts = totals[: len(names)], totals[len(names) :]
        values = {name: s / c for name, s, c in zip(names, sums, counts, strict=True)}
    # A stop already asked for checkpoints this step next: its metrics belong with it.
    if ctx.is_main and (records_step(ctx.plan, step) or ctx.stop.is_set()):
        writer.write_metrics(ctx.plan.run_id, step, values)
        if step > 0:  # step 0 is the evaluation before training
            progress.info("%s", step_line(step, ctx.plan.derived.total_steps, values))


def record_samples(
    ctx: WorkerContext, writer: BackgroundWriter, step: int, samples: Sequence[Sample]
) -> None:
    """The first `logging.samples_per_step` of this rank's samples of `step`, on the ranks that
    record (`record_metrics`'s rule), queued for the run store: other ranks' samples are drawn
    from the same prompts and add nothing to a report."""
    limit = ctx.plan.config.logging.samples_per_step
    if not limit or not samples or not ctx.is_main:
        return
    if not (records_step(ctx.plan, step) or ctx.stop.is_set()):
        return
    now = time.time()
    writer.write_samples(
        [
            SampleRecord(
                ctx.plan.run_id,
                step,
                index,
                s.prompt,
                s.completion,
                s.turns,
                s.reward,
                s.extra,
                now,
            )
            for index, s in enumerate(samples[:limit])
        ]
    )


# What a step's log line shows, in this order, when the step has it (online runs a reward,
# offline runs a loss and accuracy).
_STEP_LINE = (
    ("reward/mean", "reward {:.4g}"),
    ("train/loss", "loss {:.4g}"),
    ("train/accuracy", "accuracy {:.3g}"),
    ("train/kl", "kl {:.3g}"),
    ("perf/step_s", "{:.2f} s/step"),
    ("perf/tokens_per_s", "{:.0f} tok/s"),
)


def step_line(step: int, total: int, values: Mapping[str, float]) -> str:
    """One line of progress for the run store, so `rollout logs tail` shows how a run goes."""
    shown = [layout.format(values[name]) for name, layout in _STEP_LINE if name in values]
    return f"step {step}/{total}: " + ", ".join(shown)


def records_step(plan: Plan, step: int) -> bool:
    """Whether step `step`'s training metrics are recorded under `logging.interval`: every
    `interval` steps (and step 0, the evaluation before training), the last step, evaluation
    steps and checkpoint steps."""
    config = plan.config
    eval_interval = config.run.eval_interval
    return (
        step % config.logging.interval == 0
        or step == plan.derived.total_steps
        or step % config.checkpoint.interval == 0
        or (eval_interval is not None and step % eval_interval == 0)
    )


def record_means(
    ctx: WorkerContext,
    writer: BackgroundWriter,
    step: int,
    sums: Mapping[str, float],
    count: int,
) -> None:
    """Each metric's mean over every rank's samples, from each rank's `sums` over its `count`
    samples (the same names on every rank): a rank that evaluated more samples weighs more,
    where a mean of per-rank means would weigh every rank alike. Rank 0 writes them."""
    names = sorted(sums)
    totals = [sums[n] for n in names] + [float(count)]
    if ctx.world_size > 1:
        totals = transport.sum_metrics(totals)
    *totals, samples = totals
    means = {name: total / max(1.0, samples) for name, total in zip(names, totals, strict=True)}
    if ctx.is_main:
        writer.write_metrics(ctx.plan.run_id, step, means)
