"""The reference an offline objective compares the policy with (DPO, IPO, KTO): the model the
run began from, as a live frozen copy or as log-probs cached once in the run directory. Both answer
the objective's question the same way (rollout.runtime.offline.objectives.Reference)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollout.models.batches import CompletionBatch
from rollout.models.lora import Adapters
from rollout.runtime.context import WorkerContext
from rollout.runtime.offline.data import Split
from rollout.runtime.offline.objectives import Objective, sequence_sums
from rollout.runtime.offline.reference_cache import FILE_NAME, cache_key, cached_reference


@dataclass
class CachedReference:
    """Log-probs looked up by record: tables["{split}.{stream}"] [num_records]."""

    tables: Mapping[str, torch.Tensor]

    def sums(
        self, split: str, streams: tuple[str, ...], indices: list[int], batch: CompletionBatch
    ) -> torch.Tensor:
        rows = torch.tensor(indices, device="cpu")
        values = torch.cat([self.tables[f"{split}.{stream}"][rows] for stream in streams])
        return values.to(batch.input_ids.device)


@dataclass
class LiveReference:
    """A frozen copy of the initial model, or with LoRA the model with its adapters off, run on
    every batch."""

    model: Any

    def sums(
        self, split: str, streams: tuple[str, ...], indices: list[int], batch: CompletionBatch
    ) -> torch.Tensor:
        with torch.no_grad():
            return sequence_sums(self.model, batch)


def build_reference(
    ctx: WorkerContext,
    model: Any,
    objective: Objective,
    train_split: Split,
    eval_split: Split | None,
    adapters: Adapters | None = None,
) -> CachedReference | LiveReference:
    """The reference ``objective`` compares with: ``model`` as it is now (call it before any
    checkpoint is loaded), copied and run on every batch ("live"), or its log-probs computed once
    and kept in the run directory ("cached", rollout.runtime.offline.reference_cache). With LoRA
    `adapters`, the reference is ``model`` with its adapters off (the base model): run live
    without a copy, or cached."""
    plan = ctx.plan
    if plan.derived.keeps_reference_model:
        reference = copy.deepcopy(model).eval()
        reference.requires_grad_(False)
        return LiveReference(reference)
    if plan.derived.reference_adapters_off:
        assert adapters is not None
        return LiveReference(adapters.without_adapters())
    scorer = model if adapters is None else adapters.without_adapters()
    splits = {s.name: s for s in (train_split, eval_split) if s is not None}

    def compute(split: str, indices: list[int]) -> dict[str, list[float]]:
        with torch.no_grad():
            sums = objective.reference_sums(scorer, splits[split], indices)
        return {stream: values.tolist() for stream, values in sums.items()}

    model.eval()
    tables = cached_reference(
        Path(plan.derived.run_dir) / FILE_NAME,
        cache_key(plan),
        {name: len(split) for name, split in splits.items()},
        objective.streams,
        compute,
        # The chunks evaluation uses: at step 0 the policy then scores margins of exactly 0.
        chunk_size=plan.derived.micro_batch_size,
        rank=ctx.rank,
        world_size=ctx.world_size,
    )
    return CachedReference(tables)
