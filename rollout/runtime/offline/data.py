"""The offline objectives' data inside a worker: every record of each split, tokenized once.

Records come from the planned files through the planner's own readers (rollout.runtime.data), and
become samples by the planner's rules (rollout.models.samples) with the model's transformers
tokenizer, so the lengths `rollout plan` checked are the lengths trained on. A sample's position
in its split is its record index, the key of the reference log-prob cache and of the data cursor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout.models.loading import LoadedModel
from rollout.models.samples import (
    Demonstration,
    HfTextTokenizer,
    Judged,
    Pair,
    SampleError,
    SampleRules,
)
from rollout.planner.inspect_samples import sample_rules
from rollout.runtime.data import load_records

if TYPE_CHECKING:
    from rollout.planner.definition import Plan

Sample = Pair | Judged | Demonstration


@dataclass(frozen=True)
class Split:
    """One split's samples, by record index; for KTO also each record's mismatched completion."""

    name: str
    location: str
    samples: list[Sample]
    mismatched: list[list[int]] | None = None
    """KTO: record i's prompt is paired with record i+1's completion (cut to fit max_length) to
    estimate KL(policy || reference), as the KTO paper and TRL do."""

    def __len__(self) -> int:
        return len(self.samples)


def load_splits(plan: Plan, loaded: LoadedModel) -> tuple[Split, Split | None]:
    """The train split and, when the plan has one, the eval split, tokenized."""
    rules = sample_rules(plan.config, HfTextTokenizer.of(loaded))
    facts = {f.split: f for f in plan.data}
    sources = {"train": plan.config.data.train, "eval": plan.config.data.eval}
    splits = {}
    for name in ("train", "eval"):
        if name not in facts or sources[name] is None:
            continue
        records = load_records(facts[name].location, facts[name].format, sources[name].limit)
        splits[name] = encode_split(
            name,
            facts[name].location,
            records,
            rules,
            kind=plan.config.algorithm.kind,
            max_length=plan.config.algorithm.max_length,
        )
    return splits["train"], splits.get("eval")


def encode_split(
    name: str,
    location: str,
    records: Sequence[dict[str, Any]],
    rules: SampleRules,
    *,
    kind: str,
    max_length: int,
) -> Split:
    """Every record as a sample. Raises ValueError naming the record and field of the first
    record that makes no sample or is longer than max_length (which `rollout plan` reports
    whenever it can read the tokenizer)."""
    samples = []
    for number, record in enumerate(records, start=1):
        try:
            sample = rules.sample(kind, record)
        except SampleError as error:
            raise ValueError(
                f"record {number} of {location}: data.fields.{error.role}: {error}"
            ) from None
        if sample.length > max_length:
            raise ValueError(
                f"record {number} of {location} is {sample.length} tokens, longer than "
                f"algorithm.max_length {max_length}; raise it or drop the record"
            )
        samples.append(sample)
    mismatched = _mismatched(samples, max_length) if kind == "kto" else None
    return Split(name, location, samples, mismatched)


def _mismatched(samples: list[Sample], max_length: int) -> list[list[int]]:
    out = []
    for index, sample in enumerate(samples):
        other = samples[(index + 1) % len(samples)]
        assert isinstance(sample, Judged) and isinstance(other, Judged)
        room = max(1, max_length - len(sample.prompt))
        out.append(other.completion[:room])
    return out
