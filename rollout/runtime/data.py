"""The training records, read once per worker, and the order each rank takes them in.

`load_records` reads a JSONL or Parquet file (a local path or an fsspec URL) with the planner's own
readers, so a run sees exactly the records `rollout plan` checked and counted.

`PromptStream` deals the records to ranks. Think of the whole run as one endless sequence: the
permutation of epoch 0, then that of epoch 1, and so on. Its items are dealt round-robin, so rank
r takes items r, r + world_size, r + 2 * world_size, ... of it. Every epoch is therefore covered
exactly once across ranks, even when world_size does not divide the number of records (the deal
just carries on into the next epoch), and every rank agrees on the order without talking to the
others.

Each epoch's permutation is numpy's `Generator(PCG64(SeedSequence([seed, epoch]))).permutation`,
a pure function of (seed, epoch) and the number of records: no state beyond the cursor needs
saving. numpy keeps Generator streams stable in practice, but its policy (NEP 19) allows changes in
a feature release, so resume a run under the numpy version that started it.

When every rank calls `take` with the same n (the trainer's per-rank prompts per step), all ranks
hold the same cursor: the place in the endless sequence where the next round of dealing starts.
So one rank's `state_dict` resumes them all.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from rollout.planner.inspect_data import scan_jsonl, scan_parquet

Record = dict[str, Any]


def load_records(
    location: str, fmt: Literal["jsonl", "parquet"], limit: int | None = None
) -> list[Record]:
    """Every record of the file (or the first `limit`), in file order.

    Raises ValueError on a line that is not a JSON object: the planner checked the file, so a bad
    record here means it changed after planning.
    """
    collector = _Collector(location)
    scan = scan_jsonl if fmt == "jsonl" else scan_parquet
    scan(location, limit, collector)
    return collector.records


class _Collector:
    """Stands in for the planner's checker: keeps each record, reads every column, and turns any
    problem into an error rather than a report."""

    def __init__(self, location: str):
        self.location = location
        self.records: list[Record] = []

    def use_columns(self, columns: list[str]) -> list[str]:
        return columns

    def record(self, where: str, record: Record) -> None:
        self.records.append(record)

    def problem(self, message: str, hint: str | None = None) -> None:
        raise ValueError(message if hint is None else f"{message}; {hint}")


@dataclass(frozen=True)
class Row:
    """One record as dealt to a rank."""

    index: int
    """Position of the record in the dataset (file order, after `limit`)."""
    epoch: int
    """The pass over the dataset this row belongs to, counting from 0."""
    record: Mapping[str, Any]


class PromptStream:
    """Endless, resumable, sharded epochs over `records` (see the module docstring)."""

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        *,
        seed: int,
        shuffle: bool,
        rank: int = 0,
        world_size: int = 1,
    ):
        if not records:
            raise ValueError("PromptStream needs at least one record")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of size {world_size}")
        self._records = records
        self._seed = seed
        self._shuffle = shuffle
        self._rank = rank
        self._world_size = world_size
        self._round_start = 0  # index into the endless sequence where the next round is dealt
        self._cached_order: tuple[int, np.ndarray] | None = None

    def take(self, n: int) -> list[Row]:
        """This rank's next `n` rows, crossing into the next epoch when one runs out."""
        if n < 0:
            raise ValueError(f"cannot take {n} rows")
        first = self._round_start + self._rank
        rows = [self._row(first + i * self._world_size) for i in range(n)]
        self._round_start += n * self._world_size
        return rows

    def __iter__(self) -> Iterator[Row]:
        while True:
            yield from self.take(1)

    def state_dict(self) -> dict[str, int | bool]:
        """The cursor, as JSON-able data. `position` counts rows dealt to all ranks this epoch."""
        epoch, position = divmod(self._round_start, len(self._records))
        return {
            "epoch": epoch,
            "position": position,
            "seed": self._seed,
            "num_records": len(self._records),
            "world_size": self._world_size,
            "shuffle": self._shuffle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved cursor; refuse one whose order or dealing would differ."""
        expected = self.state_dict()
        for key in ("seed", "num_records", "world_size", "shuffle"):
            if state.get(key) != expected[key]:
                raise ValueError(
                    f"cannot resume the prompt stream: it was saved with {key}={state.get(key)!r} but "
                    f"this run has {key}={expected[key]!r}, so prompts would be repeated or "
                    f"skipped; resume with the same data, seed, shuffle and world size"
                )
        epoch, position = state["epoch"], state["position"]
        if epoch < 0 or not 0 <= position < len(self._records):
            raise ValueError(
                f"cannot resume the prompt stream: position {position} of epoch {epoch} is "
                f"outside a dataset of {len(self._records)} records"
            )
        self._round_start = epoch * len(self._records) + position

    def _row(self, sequence_index: int) -> Row:
        epoch, position = divmod(sequence_index, len(self._records))
        index = int(self._order(epoch)[position])
        return Row(index=index, epoch=epoch, record=self._records[index])

    def _order(self, epoch: int) -> np.ndarray:
        # Rows are dealt in sequence order, so epochs only move forward: caching the latest one
        # computes each permutation once.
        if self._cached_order is None or self._cached_order[0] != epoch:
            self._cached_order = (epoch, self._permutation(epoch))
        return self._cached_order[1]

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self._shuffle:
            return np.arange(len(self._records))
        generator = np.random.Generator(np.random.PCG64([self._seed, epoch]))
        return generator.permutation(len(self._records))
