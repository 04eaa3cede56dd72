"""Stale batches against the current policy, by hand: truncated importance weights, or drops."""

from __future__ import annotations

import math

import pytest
import torch

from rollout.runtime.online.batches import RolloutBatch
from rollout.runtime.online.staleness import correct_stale


def _batch() -> RolloutBatch:
    return RolloutBatch(
        prompt_ids=[[1], [1]],
        completion_ids=[[5, 6], [7]],
        old_logprobs=[[-1.0, -2.0], [-0.5]],
        rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([1.0, -1.0]),
        group_size=2,
        policy_version=0,
    )


# Ratios current / sampling: exp(0.5) = 1.65, exp(1.5) = 4.48 (over the bound 2), exp(-1) = 0.37.
CURRENT = [[-0.5, -0.5], [-1.5]]


def test_tis_weighs_each_tokens_advantage_by_its_truncated_ratio() -> None:
    batch, metrics = correct_stale(_batch(), CURRENT, "tis", 2.0)
    assert batch.old_logprobs == CURRENT  # the clipped ratio starts at 1
    assert _flat(batch.token_advantages) == pytest.approx([math.exp(0.5), 2.0, -math.exp(-1.0)])
    assert metrics["train/stale_truncated_fraction"] == pytest.approx(1 / 3)
    assert metrics["train/stale_weight_mean"] == pytest.approx(
        (math.exp(0.5) + 2.0 + math.exp(-1.0)) / 3
    )


def test_drop_zeroes_sequences_whose_ratio_leaves_the_bound() -> None:
    batch, metrics = correct_stale(_batch(), CURRENT, "drop", 2.0)
    # sequence 0 has a token at 4.48 > 2, sequence 1 one at 0.37 < 1/2: both dropped
    assert batch.token_advantages == [[0.0, 0.0], [-0.0]]
    assert metrics["train/stale_dropped_fraction"] == 1.0
    kept, metrics = correct_stale(_batch(), CURRENT, "drop", 5.0)
    assert kept.token_advantages == [[1.0, 1.0], [-1.0]]
    assert metrics["train/stale_dropped_fraction"] == 0.0


def test_per_token_advantages_are_weighed_too() -> None:
    batch = _batch()
    batch.token_advantages = [[0.5, 0.25], [2.0]]
    corrected, _ = correct_stale(batch, CURRENT, "tis", 2.0)
    assert _flat(corrected.token_advantages) == pytest.approx(
        [0.5 * math.exp(0.5), 0.5, 2.0 * math.exp(-1.0)]
    )


def _flat(rows):
    return [x for row in rows for x in row]
