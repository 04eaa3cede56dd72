"""The pure parts of several actors sharing a step's prompts: pooled metrics, tags, shares."""

from __future__ import annotations

import pytest
import torch

from rollout.runtime.online.shared_prompts import (
    learner_shares,
    message_tag,
    pool_chunk_metrics,
    queue_metrics,
)


def _chunk(rewards: list[float], tokens: float, seconds: float) -> tuple[int, dict[str, float]]:
    values = torch.tensor(rewards, dtype=torch.float64)
    return len(rewards), {
        "reward/mean": values.mean().item(),
        "reward/std": values.std().item() if len(rewards) > 1 else 0.0,
        "completion/tokens_mean": tokens,
        "perf/generated_tokens": tokens * len(rewards),
        "perf/generate_s": seconds,
    }


def test_pooled_metrics_are_those_of_the_whole_batch():
    chunks = [
        _chunk([0.0, 1.0, 0.5, 0.25], 3.0, 1.0),
        _chunk([2.0, 2.0, 2.0, 2.0], 5.0, 2.0),
        _chunk([-1.0, 3.0, 0.0, 1.0, 4.0, 0.5, 0.5, 0.5], 1.0, 0.5),
    ]
    everything = torch.tensor(
        [0.0, 1.0, 0.5, 0.25, 2.0, 2.0, 2.0, 2.0, -1.0, 3.0, 0.0, 1.0, 4.0, 0.5, 0.5, 0.5],
        dtype=torch.float64,
    )
    pooled = pool_chunk_metrics(chunks, actors=2)
    assert pooled["reward/mean"] == pytest.approx(everything.mean().item())
    assert pooled["reward/std"] == pytest.approx(everything.std().item())
    # Rows weigh the means: (4 * 3 + 4 * 5 + 8 * 1) / 16.
    assert pooled["completion/tokens_mean"] == pytest.approx(40 / 16)
    # Tokens and seconds are summed over chunks, then given per actor.
    assert pooled["perf/generated_tokens"] == pytest.approx((12 + 20 + 8) / 2)
    assert pooled["perf/generate_s"] == pytest.approx(3.5 / 2)


def test_queue_metrics_name_each_actor():
    summaries = [
        {
            "actor": i,
            "perf/actor_wait_s": wait,
            "queue": {
                "queue/chunks_claimed": claimed,
                "queue/wait_s": 0.1 * i,
                "queue/chunks_requeued": requeued,
                "queue/completions_ignored": 0.0,
            },
        }
        for i, (claimed, requeued, wait) in enumerate([(5.0, 1.0, 0.2), (3.0, 0.0, 0.4)])
    ]
    metrics = queue_metrics(summaries)
    assert metrics["queue/chunks_claimed/actor_0"] == 5.0
    assert metrics["queue/chunks_claimed/actor_1"] == 3.0
    assert metrics["queue/wait_s/actor_1"] == pytest.approx(0.1)
    assert metrics["queue/chunks_requeued"] == 1.0
    assert metrics["perf/actor_wait_s"] == pytest.approx(0.3)


def test_tags_differ_for_every_chunk_of_the_steps_in_flight_and_fit_gloo():
    tags = {message_tag(step, slot) for step in (1, 2, 3) for slot in [*range(100), 0xFFFF]}
    assert len(tags) == 3 * 101
    assert all(0 <= t < 2**31 for t in tags)
    assert 0 <= message_tag(10**9, 0xFFFF) < 2**31


def test_learners_split_the_step_in_equal_runs_of_rows():
    assert learner_shares(32, 1) == [(0, 32)]
    assert learner_shares(32, 2) == [(0, 16), (16, 32)]
