"""The batches an asynchronous learner holds ahead of their step round-trip through a checkpoint's
buffer/ exactly: every token, log-prob, reward, text and header, for each learner."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollout.runtime.online import pending as pending_module
from rollout.runtime.online.batches import RolloutBatch
from rollout.runtime.online.pending import (
    PendingBatches,
    gather_shares,
    read_share,
    write_shares,
)


def batch(seed: int, version: int) -> RolloutBatch:
    generator = torch.Generator().manual_seed(seed)
    rows = 4
    completions = [
        torch.randint(0, 50_000, (n,), generator=generator).tolist() for n in (3, 0, 5, 1)
    ]
    return RolloutBatch(
        prompt_ids=[
            torch.randint(0, 50_000, (2 + i,), generator=generator).tolist() for i in range(rows)
        ],
        completion_ids=completions,
        # float32 values, as the wire carries them: arbitrary bits, not round decimals.
        old_logprobs=[
            (-torch.rand(len(c), generator=generator) * 7).float().tolist() for c in completions
        ],
        rewards=torch.rand(rows, generator=generator, dtype=torch.float32) - 0.5,
        advantages=torch.randn(rows, generator=generator, dtype=torch.float32),
        group_size=2,
        policy_version=version,
        texts=["3 + 4 = 7", "", "naïve «quoted» ✓", "\n\t"],
    )


METRICS = {"reward/mean": 0.1234567890123, "perf/actor_wait_s": 0.0, "reward/std": 1e-300}


def held(*steps: int, seed: int = 0) -> PendingBatches:
    pending = PendingBatches()
    for step in steps:
        pending.put(step, batch(seed + step, version=step - 2), {**METRICS, "step": float(step)})
    return pending


def assert_same_batch(a: RolloutBatch, b: RolloutBatch) -> None:
    assert a.prompt_ids == b.prompt_ids
    assert a.completion_ids == b.completion_ids
    assert a.old_logprobs == b.old_logprobs  # exact floats, row by row
    for name in ("rewards", "advantages"):
        left, right = getattr(a, name), getattr(b, name)
        assert left.dtype == right.dtype and torch.equal(left, right), name
    assert (a.group_size, a.policy_version, a.texts) == (b.group_size, b.policy_version, b.texts)
    assert (a.token_advantages, a.old_values, a.returns) == (None, None, None)


def test_each_learners_share_round_trips_exactly(tmp_path: Path):
    learners = [held(3, 4, seed=0), held(3, 4, seed=100)]
    write_shares(tmp_path, [learner.share() for learner in learners])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "learner-0.json",
        "learner-0.safetensors",
        "learner-1.json",
        "learner-1.safetensors",
    ]
    for index, original in enumerate(learners):
        restored = PendingBatches()
        restored.put(9, batch(9, 0), {})  # reading replaces what was held
        restored.read(tmp_path, index)
        assert restored.steps() == [3, 4]
        for step in (3, 4):
            (want, want_metrics), (got, got_metrics) = original.take(step), restored.take(step)
            assert_same_batch(got, want)
            assert got_metrics == want_metrics
        assert len(restored) == 0


def test_the_files_are_json_and_safetensors_named_by_step(tmp_path: Path):
    write_shares(tmp_path, [held(5).share()])
    headers = json.loads((tmp_path / "learner-0.json").read_text())
    assert [(h["step"], h["tensors"], h["header"]["policy_version"]) for h in headers] == [
        (5, 5, 3)
    ]
    # safetensors: an 8-byte little-endian header length, then a JSON header; never a pickle.
    data = (tmp_path / "learner-0.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    names = set(json.loads(data[8 : 8 + size])) - {"__metadata__"}
    assert names == {f"5.{i}" for i in range(5)}
    assert len(read_share(tmp_path, 0)) == 1


def test_no_buffer_holds_nothing_and_a_missing_learner_is_named(tmp_path: Path):
    pending = held(2)
    pending.read(tmp_path / "buffer", 0)  # a checkpoint of a run with max_staleness = 0
    assert len(pending) == 0
    write_shares(tmp_path, [held(2).share()])
    with pytest.raises(ValueError, match="no pending batches of learner 1"):
        pending.read(tmp_path, 1)


def test_other_learners_shares_cross_the_json_gather_exactly(tmp_path: Path, monkeypatch):
    """With several learners the first gathers the others' shares as JSON (transport's gather):
    their float32 and int64 tensors come through bit for bit."""
    learners = [held(7, 8, seed=0), held(7, 8, seed=50)]

    def gather(ctx, value):
        others = [learner.share() for learner in learners[1:]]
        encoded = [
            [{**e, "tensors": [pending_module._encode(t) for t in e["tensors"]]} for e in share]
            for share in others
        ]
        travelled = json.loads(json.dumps([value, *encoded]))
        return {str(index): share for index, share in enumerate(travelled)}

    monkeypatch.setattr(pending_module, "gather_by_rank", gather)
    shares = gather_shares(SimpleNamespace(learners=2), learners[0])
    write_shares(tmp_path, shares)
    for index, original in enumerate(learners):
        restored = PendingBatches()
        restored.read(tmp_path, index)
        for step in (7, 8):
            assert_same_batch(restored.take(step)[0], original.take(step)[0])
