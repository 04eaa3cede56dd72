"""The batches an asynchronous disaggregated run's learners hold ahead of training them, and how a
checkpoint keeps them.

With algorithm.max_staleness = k >= 1, batch t is sampled with the weights of version
max(0, t - 1 - k): when the learners checkpoint step s, batches s+1..s+k were sampled (or are
being sampled) with weights older than the checkpoint's. A resumed run that sampled them again
would sample them with version s and train on other batches than an uninterrupted run. So before
each checkpoint the learners receive those batches (rollout.runtime.online.disaggregated), keep
them here, and the next steps take them from here; the checkpoint holds each learner's share:

    buffer/
        learner-0.json          [{"step", "metrics", "header", "tensors"}, ...] in step order: the
                                batch's wire header (rollout.runtime.online.batches.to_wire), the
                                actors' metrics of the step, how many tensors it has
        learner-0.safetensors   those tensors, "<step>.<i>" for the batch's i-th (to_wire's order)
        learner-1.json ...      and so on, one pair per learner (its index among the learners)

Nothing is pickled: headers are JSON, tensors safetensors. The first learner writes every file
(it writes the checkpoint); the other learners' shares reach it through the learners' JSON gather
(rollout.runtime.transport.gather_state), their tensors as exact lists of numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from rollout.runtime.online.batches import RolloutBatch, from_wire, to_wire
from rollout.runtime.run_state import gather_by_rank

if TYPE_CHECKING:
    from rollout.runtime.context import WorkerContext

BUFFER = "buffer"
"""The checkpoint directory the pending batches are saved in."""

_DTYPES = {str(dtype): dtype for dtype in (torch.int64, torch.float32)}
"""The dtypes of a batch's wire tensors (to_wire)."""

Share = list[dict[str, Any]]
"""One learner's pending batches as saved: per step, its "step", "metrics", "header" and
"tensors" (a list of tensors)."""


class PendingBatches:
    """This learner's share of the batches received ahead of their step, by step."""

    def __init__(self) -> None:
        self._steps: dict[int, tuple[RolloutBatch, dict[str, float]]] = {}

    def __contains__(self, step: int) -> bool:
        return step in self._steps

    def __len__(self) -> int:
        return len(self._steps)

    def steps(self) -> list[int]:
        return sorted(self._steps)

    def put(self, step: int, batch: RolloutBatch, metrics: dict[str, float]) -> None:
        self._steps[step] = (batch, metrics)

    def take(self, step: int) -> tuple[RolloutBatch, dict[str, float]] | None:
        """The batch of `step` and its actors' metrics, no longer held; None if not held."""
        return self._steps.pop(step, None)

    def share(self) -> Share:
        """What this learner saves: its batches in their wire form, in step order."""
        entries = []
        for step in self.steps():
            batch, metrics = self._steps[step]
            header, tensors = to_wire(batch)
            entries.append({"step": step, "metrics": metrics, "header": header, "tensors": tensors})
        return entries

    def read(self, directory: Path, index: int) -> None:
        """Hold learner `index`'s batches of the checkpoint directory `directory` (buffer/ of a
        checked local copy), instead of any held now; none when the checkpoint has no buffer (a
        run with max_staleness = 0, or a checkpoint from before buffers were saved)."""
        self._steps.clear()
        if not directory.is_dir():
            return
        for entry in read_share(directory, index):
            batch = from_wire(entry["header"], entry["tensors"])
            self.put(entry["step"], batch, entry["metrics"])


def gather_shares(ctx: WorkerContext, pending: PendingBatches) -> list[Share]:
    """Every learner's share, by learner index; collective over the learners (each must hold
    the same steps). Only the first learner's result is of use: it writes them."""
    own = pending.share()
    if ctx.learners == 1:
        return [own]
    # The tensors travel as lists of numbers: int64 and float32 values survive JSON exactly.
    encoded = [{**entry, "tensors": [_encode(t) for t in entry["tensors"]]} for entry in own]
    shares = gather_by_rank(ctx, encoded)
    return [
        [{**entry, "tensors": [_decode(t) for t in entry["tensors"]]} for entry in shares[index]]
        for index in sorted(shares, key=int)
    ]


def write_shares(directory: Path, shares: list[Share]) -> None:
    """Write every learner's share into `directory` (a checkpoint's fresh buffer/)."""
    for index, share in enumerate(shares):
        tensors, headers = {}, []
        for entry in share:
            for i, tensor in enumerate(entry["tensors"]):
                tensors[f"{entry['step']}.{i}"] = tensor.detach().cpu().contiguous()
            headers.append(
                {
                    "step": entry["step"],
                    "metrics": entry["metrics"],
                    "header": entry["header"],
                    "tensors": len(entry["tensors"]),
                }
            )
        save_file(tensors, directory / f"learner-{index}.safetensors")
        text = json.dumps(headers, indent=1)
        (directory / f"learner-{index}.json").write_text(text, encoding="utf-8")


def read_share(directory: Path, index: int) -> Share:
    """Learner `index`'s share as `write_shares` wrote it."""
    headers_path = directory / f"learner-{index}.json"
    tensors_path = directory / f"learner-{index}.safetensors"
    if not headers_path.is_file() or not tensors_path.is_file():
        raise ValueError(
            f"{directory} holds no pending batches of learner {index} ({headers_path.name} and "
            f"{tensors_path.name}): the checkpoint was saved by a run with fewer learners"
        )
    headers = json.loads(headers_path.read_text(encoding="utf-8"))
    tensors = load_file(tensors_path)
    return [
        {**entry, "tensors": [tensors[f"{entry['step']}.{i}"] for i in range(entry["tensors"])]}
        for entry in headers
    ]


def _encode(tensor: torch.Tensor) -> list[Any]:
    return [str(tensor.dtype), tensor.tolist()]


def _decode(encoded: list[Any]) -> torch.Tensor:
    dtype, values = encoded
    return torch.tensor(values, dtype=_DTYPES[dtype], device="cpu")
