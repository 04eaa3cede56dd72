"""What both training loops checkpoint and resume, rank by rank.

Rank 0 writes the checkpoint (rollout.runtime.checkpoint: weights, optimizer, scheduler and its
own RNG states): ranks hold identical weights and optimizer state, or, with a sharded learner
(rollout.runtime.sharding), every rank gathers its shards to rank 0 first. What differs by rank travels
in the trainer state: every rank's data cursor, and the RNG states of every other rank. A resumed
rank therefore takes the records and draws the numbers (dropout masks, sampling seeds, anything
from torch's, numpy's or Python's global generators) it would have had the run never stopped.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rollout.files import is_url
from rollout.runtime import transport
from rollout.runtime.checkpoint import (
    CheckpointError,
    CopyBuffers,
    Extra,
    FullState,
    LoopFiles,
    Staged,
    commit_checkpoint,
    load_checkpoint,
    prune,
    rng_state,
    set_rng_state,
    stage_checkpoint,
)
from rollout.runtime.data import PromptStream
from rollout.runtime.manifest import Found, inventory, plan_fingerprint
from rollout.runtime.sharding import (
    ShardedLoader,
    first_learner_reads_alone,
    gather_full_state,
    is_sharded,
)
from rollout.tracing import span

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
    stream: PromptStream | None
    """The rank's prompt cursor; None on a learner of a disaggregated run (its actors take the
    prompts, and skip the steps a resumed run already trained)."""
    extras: Mapping[str, Extra] = field(default_factory=dict)
    """Modules trained beside the policy (PPO's critic or value head)."""
    adapters: Adapters | None = None
    """With LoRA: the adapters, which checkpoints hold instead of the model's weights."""
    buffers: CopyBuffers = field(default_factory=CopyBuffers)
    """Under an object-store root: the memory each save copies the large tensors into."""

    def save(
        self,
        ctx: WorkerContext,
        writer: BackgroundWriter,
        step: int,
        trainer_state: Mapping[str, Any] | None = None,
        loop_files: LoopFiles | None = None,
    ) -> None:
        """Checkpoint `step` with the loop's own `trainer_state` beside the cursors and RNG
        states, and the directories of `loop_files` (written by the first learner alone);
        collective (every rank calls it).

        Under an object-store root the checkpoint is committed by an upload thread
        (ctx.uploads) while the next steps train; the run store's record of it is written when
        it is committed. perf/checkpoint_blocking_s is what the save held the loop up for.
        It runs in the span "checkpoint" (rollout.tracing)."""
        with span("checkpoint", step=step):
            self._save(ctx, writer, step, trainer_state, loop_files)

    def _save(
        self,
        ctx: WorkerContext,
        writer: BackgroundWriter,
        step: int,
        trainer_state: Mapping[str, Any] | None,
        loop_files: LoopFiles | None,
    ) -> None:
        # Everything recorded up to this step reaches the store before the checkpoint exists, so
        # a crash after it loses no metric or log line of the steps it covers.
        writer.flush()
        cursors = gather_by_rank(ctx, None if self.stream is None else self.stream.state_dict())
        rng = gather_rng(ctx)
        full = None
        if is_sharded(self.model) and step > 0:  # every rank sends its shards to rank 0
            with_optimizer = ctx.plan.config.checkpoint.save_optimizer
            full = gather_full_state(self.model, self.optimizer if with_optimizer else None)
        if ctx.is_main and step > 0:
            started = time.perf_counter()
            ctx.uploads.wait()  # the previous upload is committed (or its failure raised) first
            staged = self._stage(ctx, step, cursors, rng, trainer_state, full, loop_files)
            commit = functools.partial(self._commit, ctx, writer, staged)
            if is_url(self.root):
                ctx.uploads.start(f"upload of checkpoint step {step}", commit)
            else:
                commit()
            blocking = time.perf_counter() - started
            writer.write_metrics(ctx.plan.run_id, step, {"perf/checkpoint_blocking_s": blocking})
        if ctx.learners > 1:
            transport.wait_for_every_rank()

    def _stage(
        self,
        ctx: WorkerContext,
        step: int,
        cursors: dict[str, Any],
        rng: dict[str, Any],
        trainer_state: Mapping[str, Any] | None,
        full: FullState | None,
        loop_files: LoopFiles | None,
    ) -> Staged:
        with_optimizer = ctx.plan.config.checkpoint.save_optimizer
        return stage_checkpoint(
            self.root,
            step,
            model=self.model,
            tokenizer=self.tokenizer,
            optimizer=self.optimizer if with_optimizer else None,
            scheduler=self.scheduler if with_optimizer else None,
            trainer_state={**(trainer_state or {}), "step": step, "cursor": cursors, "rng": rng},
            extras=self.extras,
            adapters=self.adapters,
            run_id=ctx.plan.run_id,
            plan=plan_fingerprint(ctx.plan),
            buffers=self.buffers,
            full_state=full,
            loop_files=loop_files,
        )

    def _commit(self, ctx: WorkerContext, writer: BackgroundWriter, staged: Staged) -> None:
        """Publish, then retention, then the store's record: in that order, so that neither
        ever names or deletes for a checkpoint that is not committed."""
        started = time.perf_counter()
        location = commit_checkpoint(staged)
        prune(self.root, ctx.plan.config.checkpoint.keep_last)
        writer.write_checkpoint(ctx.plan.run_id, staged.step, str(location))
        writer.write_metrics(
            ctx.plan.run_id,
            staged.step,
            {"perf/checkpoint_commit_s": time.perf_counter() - started},
        )
        log.info("checkpoint %s committed", location)

    def resume(
        self, ctx: WorkerContext, loop_files: LoopFiles | None = None
    ) -> dict[str, Any] | None:
        """Restore the newest good checkpoint, if any, and return its trainer state (its "step"
        and what the loop saved with it); None for a fresh run. Each of `loop_files` reads its
        directory of the checkpoint restored.

        Newer checkpoints that were never committed or are damaged are skipped, each with a
        warning in the run's logs naming what is wrong. A checkpoint of another plan is refused
        (CheckpointError): resuming it would train some other run on."""
        fingerprint = plan_fingerprint(ctx.plan)
        for found in reversed(inventory(self.root)):
            if found.problems:
                _skip(found.location, found.problems)
                continue
            _refuse_another_plan(ctx, self.root, found, fingerprint)
            try:
                state = self._load(ctx, found.location, loop_files)
            except CheckpointError as error:  # a hash that does not match: checked before use
                _skip(found.location, [str(error)])
                continue
            log.info("resumed from %s at step %d", found.location, state["step"])
            return state
        return None

    def _load(
        self, ctx: WorkerContext, location: str | Path, loop_files: LoopFiles | None
    ) -> dict[str, Any]:
        # Saved without optimizer state (checkpoint.save_optimizer = false): fresh ones.
        with_optimizer = ctx.plan.config.checkpoint.save_optimizer
        state = load_checkpoint(
            location,
            model=self.model,
            optimizer=self.optimizer if with_optimizer else None,
            scheduler=self.scheduler if with_optimizer else None,
            extras=self.extras,
            adapters=self.adapters,
            full_state=self._sharded_loader(ctx, with_optimizer),
            loop_files=loop_files,
        )
        index = ctx.seed_index
        if self.stream is not None:
            self.stream.load_state_dict(state["cursor"][str(index)])
        # load_checkpoint restored the RNG states of the rank that saved (the first learner);
        # every other learner's are in the trainer state.
        rng = state.get("rng", {})
        if index != 0:
            if str(index) not in rng:
                log.warning(
                    "%s holds no RNG state for rank %d: its random draws will differ from an "
                    "uninterrupted run's",
                    location,
                    ctx.rank,
                )
            else:
                set_rng_state(rng[str(index)])
        return state

    def _sharded_loader(self, ctx: WorkerContext, with_optimizer: bool) -> ShardedLoader | None:
        if not is_sharded(self.model):
            return None
        reads = ctx.is_main or not first_learner_reads_alone()
        return ShardedLoader(self.model, self.optimizer if with_optimizer else None, reads)


def _skip(location: str | Path, problems: list[str]) -> None:
    log.warning("skipping checkpoint %s: %s", location, "; ".join(problems))


def _refuse_another_plan(ctx: WorkerContext, root: str | Path, found: Found, ours: str) -> None:
    assert found.manifest is not None  # committed
    theirs = found.manifest["plan"]
    if theirs == ours:
        return
    raise CheckpointError(
        f"{found.location} was saved by another plan (run {found.manifest['run_id']}, plan "
        f"fingerprint {theirs[:12]}), and this run {ctx.plan.run_id} has plan fingerprint "
        f"{ours[:12]}: their base model, LoRA shape, algorithm, training data or number of "
        f"ranks differ, so it cannot be resumed. Give this run a storage.artifacts of its own, "
        f"or move the checkpoints out of {root} to start fresh"
    )


def gather_by_rank(ctx: WorkerContext, value: Any) -> dict[str, Any]:
    """Every learner rank's `value` (JSON data), keyed by its index among the learners (its rank
    when colocated) as a string; collective."""
    if ctx.learners == 1:
        return {"0": value}
    return {str(rank): item for rank, item in enumerate(transport.gather_state(value))}


def gather_rng(ctx: WorkerContext) -> dict[str, Any]:
    """Every learner rank's RNG states but the first's (a checkpoint's own RNG files hold
    those)."""
    if ctx.learners == 1:
        return {}
    return {rank: state for rank, state in gather_by_rank(ctx, rng_state()).items() if rank != "0"}
