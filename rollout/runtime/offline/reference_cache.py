"""Reference log-probs computed once per run and kept in the run directory.

DPO, IPO and KTO compare the policy with the frozen model it started from. With
``reference = "cached"`` the worker computes that model's sequence log-probs for every record
before the first step, with the policy itself (it is the reference until it is first updated), so
no second copy of the model is ever held. They are stored as

    RUN_DIR/reference-logprobs.safetensors
        tensors   "{split}.{stream}" -> [num_records] float32, indexed by record
                  (streams: chosen and rejected; KTO's completion and mismatched), computed in
                  the chunks evaluation uses, so that at step 0 margins are exactly 0
        metadata  the cache key: the plan's model fingerprint, the data files' fingerprints and
                  every setting that changes the token ids

A resumed run finds the file and reads it; a file whose key differs (another model, other data,
other tokenization) is never used: it is computed afresh and replaced. Each rank computes its
share of the records, the shares are gathered, and rank 0 writes the file (atomically).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rollout.runtime import transport

if TYPE_CHECKING:
    from rollout.planner.definition import Plan

log = logging.getLogger("rollout.reference")

FILE_NAME = "reference-logprobs.safetensors"
FORMAT_VERSION = "1"

ComputeChunk = Callable[[str, list[int]], Mapping[str, list[float]]]
"""(split, record indices) -> each stream's reference log-probs of those records."""


def cache_key(plan: Plan) -> dict[str, str]:
    """What the cached numbers depend on; a file with any other key is not reused."""
    config = plan.config
    settings = {
        "kind": config.algorithm.kind,
        "max_length": config.algorithm.max_length,
        "dtype": plan.derived.dtype,
        "model": config.model.model_dump(mode="json"),
        "data": config.data.model_dump(mode="json", exclude={"shuffle"}),
    }
    canonical = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return {
        "format_version": FORMAT_VERSION,
        "model_fingerprint": plan.model.fingerprint,
        "data_fingerprints": ",".join(f"{f.split}:{f.fingerprint}" for f in plan.data),
        "settings_sha256": hashlib.sha256(canonical.encode()).hexdigest(),
    }


def cached_reference(
    path: Path,
    key: dict[str, str],
    splits: Mapping[str, int],
    streams: tuple[str, ...],
    compute: ComputeChunk,
    *,
    chunk_size: int,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, torch.Tensor]:
    """Every "{split}.{stream}" table of reference log-probs (``splits`` gives each split's
    record count), from ``path`` if its key matches, else computed (this rank's share of the
    chunks of ``chunk_size`` records, progress logged) and saved there."""
    expected = {f"{split}.{stream}": n for split, n in splits.items() for stream in streams}
    found = _read(path, key)
    if found is not None and all(
        name in found and found[name].numel() == n for name, n in expected.items()
    ):
        log.info("reference log-probs: reusing %s", path)
        return found
    total = sum(expected.values())
    log.info("reference log-probs: computing %d sequences once, into %s", total, path)
    done, next_report = 0, 0.1
    tensors = {}
    for split, count in splits.items():
        # Chunks of consecutive records, dealt round-robin to ranks: each chunk is batched as
        # evaluation batches it, whichever rank computes it.
        chunks = [list(range(i, min(i + chunk_size, count))) for i in range(0, count, chunk_size)]
        values: dict[str, dict[int, float]] = {stream: {} for stream in streams}
        for indices in chunks[rank::world_size]:
            for stream, sums in compute(split, indices).items():
                values[stream].update(zip(indices, sums, strict=True))
            done += len(indices) * world_size * len(streams)  # the other ranks keep pace
            if done >= next_report * total:
                log.info("reference log-probs: %d/%d sequences", min(done, total), total)
                next_report = done / total + 0.1
        for stream in streams:
            tensors[f"{split}.{stream}"] = _gathered(values[stream], count, world_size)
    if rank == 0:
        _write(path, tensors, key)
    if world_size > 1:
        transport.wait_for_every_rank()
    return tensors


def _gathered(values: dict[int, float], count: int, world_size: int) -> torch.Tensor:
    if world_size > 1:
        shares = transport.gather_state({str(i): v for i, v in values.items()})
        values = {int(i): v for share in shares for i, v in share.items()}
    return torch.tensor([values[i] for i in range(count)], dtype=torch.float32, device="cpu")


def _read(path: Path, key: dict[str, str]) -> dict[str, torch.Tensor] | None:
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if metadata != key:
        changed = sorted(k for k in set(key) | set(metadata) if key.get(k) != metadata.get(k))
        log.warning(
            "reference log-probs: %s was computed for a different %s; computing them again",
            path,
            ", ".join(changed),
        )
        return None
    return load_file(str(path))


def _write(path: Path, tensors: dict[str, torch.Tensor], key: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial), metadata=key)
    os.replace(partial, path)  # atomic: a reader sees the old file or the whole new one
