"""What every training loop reports across ranks, written by rank 0 (through the background
writer, off the hot path): step metrics averaged over ranks, evaluation means over every rank's
samples, and per-rank state gathered for a checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rollout.runtime.checkpoint import rng_state
from rollout.runtime.transport import all_gather_json

if TYPE_CHECKING:
    from rollout.runtime.worker import WorkerContext
    from rollout.storage.writer import BackgroundWriter


def record_metrics(
    ctx: WorkerContext, writer: BackgroundWriter, step: int, metrics: Mapping[str, float]
) -> None:
    """Average metrics over ranks (each rank's are over equal shares of the step); rank 0
    writes them."""
    values = dict(metrics)
    if ctx.world_size > 1:
        names = sorted(values)
        totals = _sum_over_ranks([values[n] for n in names])
        values = {name: total / ctx.world_size for name, total in zip(names, totals, strict=True)}
    if ctx.is_main:
        writer.write_metrics(ctx.plan.run_id, step, values)


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
        totals = _sum_over_ranks(totals)
    *totals, samples = totals
    means = {name: total / max(1.0, samples) for name, total in zip(names, totals, strict=True)}
    if ctx.is_main:
        writer.write_metrics(ctx.plan.run_id, step, means)


def _sum_over_ranks(values: list[float]) -> list[float]:
    """Element-wise sums of every rank's `values` (the same length everywhere); collective."""
    stacked = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(stacked)
    return stacked.tolist()


def gather_by_rank(ctx: WorkerContext, value: Any) -> dict[str, Any]:
    """Every rank's `value` (JSON data), keyed by rank as a string; collective."""
    if ctx.world_size == 1:
        return {"0": value}
    return {str(rank): item for rank, item in enumerate(all_gather_json(value))}


def gather_rng(ctx: WorkerContext) -> dict[str, Any]:
    """Every rank's RNG states but rank 0's (a checkpoint's own RNG files hold those)."""
    if ctx.world_size == 1:
        return {}
    return {rank: state for rank, state in gather_by_rank(ctx, rng_state()).items() if rank != "0"}
