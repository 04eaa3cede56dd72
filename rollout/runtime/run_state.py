"""What both training loops checkpoint and resume, rank by rank.

Rank 0 writes the checkpoint (rollout.runtime.checkpoint: weights, optimizer, scheduler and its
own RNG states): ranks hold identical weights and optimizer state. What differs by rank travels
in the trainer state: every rank's data cursor, and the RNG states of every other rank. A resumed
rank therefore takes the records and draws the numbers (dropout masks, sampling seeds, anything
from torch's, numpy's or Python's global generators) it would have had the run never stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rollout.runtime import transport
from rollout.runtime.checkpoint import (
    Extra,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from rollout.runtime.data import PromptStream

if TYPE_CHECKING:
    from rollout.models.lora import Adapters
    from rollout.runtime.context import WorkerContext
    from rollout.storage.writer import BackgroundWriter

log = logging.getLogger("rollout.checkpoint")


@dataclass
class RunState:
    """The parts of a run a checkpoint holds, saved under `root` (the plan's artifacts: a local
    directory or an fsspec URL)."""

    root: str | Path
    model: Any
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: PromptStream
    extras: Mapping[str, Extra] = field(default_factory=dict)
    """Modules trained beside the policy (PPO's critic or value head)."""
    adapters: Adapters | None = None
    """With LoRA: the adapters, which checkpoints hold instead of the model's weights."""

    def save(
        self,
        ctx: WorkerContext,
        writer: BackgroundWriter,
        step: int,
        trainer_state: Mapping[str, Any] | None = None,
    ) -> None:
        """Checkpoint `step` with the loop's own `trainer_state` beside the cursors and RNG
        states; collective (every rank calls it)."""
        # Everything recorded up to this step reaches the store before the checkpoint exists, so
        # a crash after it loses no metric or log line of the steps it covers.
        writer.flush()
        cursors = gather_by_rank(ctx, self.stream.state_dict())
        rng = gather_rng(ctx)
        if ctx.is_main and step > 0:
            with_optimizer = ctx.plan.config.checkpoint.save_optimizer
            path = save_checkpoint(
                self.root,
                step,
                model=self.model,
                tokenizer=self.tokenizer,
                optimizer=self.optimizer if with_optimizer else None,
                scheduler=self.scheduler if with_optimizer else None,
                trainer_state={
                    **(trainer_state or {}),
                    "step": step,
                    "cursor": cursors,
                    "rng": rng,
                },
                keep_last=ctx.plan.config.checkpoint.keep_last,
                extras=self.extras,
                adapters=self.adapters,
            )
            writer.write_checkpoint(ctx.plan.run_id, step, str(path))
            log.info("checkpoint %s", path)
        if ctx.world_size > 1:
            transport.wait_for_every_rank()

    def resume(self, ctx: WorkerContext) -> dict[str, Any] | None:
        """Restore the latest complete checkpoint, if any, and return its trainer state (its
        "step" and what the loop saved with it); None for a fresh run."""
        latest = latest_checkpoint(self.root)
        if latest is None:
            return None
        # Saved without optimizer state (checkpoint.save_optimizer = false): fresh ones.
        with_optimizer = ctx.plan.config.checkpoint.save_optimizer
        state = load_checkpoint(
            latest,
            model=self.model,
            optimizer=self.optimizer if with_optimizer else None,
            scheduler=self.scheduler if with_optimizer else None,
            extras=self.extras,
            adapters=self.adapters,
        )
        self.stream.load_state_dict(state["cursor"][str(ctx.rank)])
        # load_checkpoint restored the RNG states of the rank that saved (rank 0); every other
        # rank's are in the trainer state.
        rng = state.get("rng", {})
        if ctx.rank != 0:
            if str(ctx.rank) not in rng:
                log.warning(
                    "%s holds no RNG state for rank %d: its random draws will differ from an "
                    "uninterrupted run's",
                    latest,
                    ctx.rank,
                )
            else:
                set_rng_state(rng[str(ctx.rank)])
        log.info("resumed from %s at step %d", latest, state["step"])
        return state


def gather_by_rank(ctx: WorkerContext, value: Any) -> dict[str, Any]:
    """Every rank's `value` (JSON data), keyed by rank as a string; collective."""
    if ctx.world_size == 1:
        return {"0": value}
    return {str(rank): item for rank, item in enumerate(transport.gather_state(value))}


def gather_rng(ctx: WorkerContext) -> dict[str, Any]:
    """Every rank's RNG states but rank 0's (a checkpoint's own RNG files hold those)."""
    if ctx.world_size == 1:
        return {}
    return {rank: state for rank, state in gather_by_rank(ctx, rng_state()).items() if rank != "0"}
