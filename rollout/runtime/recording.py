"""What every training loop reports across ranks: metrics averaged over ranks and written by rank 0
(through the background writer, off the hot path), and per-rank state gathered for a checkpoint."""

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
    """Average metrics over ranks; rank 0 writes them."""
    values = dict(metrics)
    if ctx.world_size > 1:
        names = sorted(values)
        stacked = torch.tensor([values[n] for n in names], dtype=torch.float64)
        dist.all_reduce(stacked)
        values = dict(zip(names, (stacked / ctx.world_size).tolist(), strict=True))
    if ctx.is_main:
        writer.write_metrics(ctx.plan.run_id, step, values)


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
