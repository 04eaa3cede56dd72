"""Held-out evaluation: one greedy completion per prompt, scored by the run's rewards."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout.engines.base import Engine, SamplingParams
from rollout.harness.reward_runner import RewardRunner
from rollout.runtime.online.actor import PromptFormat


def evaluate(
    engine: Engine,
    prompt_format: PromptFormat,
    rewards: RewardRunner,
    rows: Sequence[Mapping[str, Any]],
    generation: Any,
) -> tuple[dict[str, float], int]:
    """Summed rewards (total and per function) of greedy completions on ``rows``, and how many
    rows they cover. Sums, not means: ranks evaluate shards of different sizes, so the means
    are taken over every rank's sums and counts (rollout.runtime.recording.record_means)."""
    names = ["eval/reward", *(f"eval/{f.name}" for f in rewards.functions)]
    if not rows:  # a rank with no share of a small eval set still takes part in the reduction
        return dict.fromkeys(names, 0.0), 0
    prompts = [prompt_format.prompt_text(row) for row in rows]
    params = SamplingParams(
        max_new_tokens=generation.max_new_tokens, temperature=0.0, stop=tuple(generation.stop), n=1
    )
    completions = engine.generate([prompt_format.encode(p) for p in prompts], params)
    scores = rewards.score(
        prompts, [c.text for c in completions], [prompt_format.reward_row(row) for row in rows]
    )
    sums = {"eval/reward": sum(scores.total)}
    for name, values in scores.per_function.items():
        sums[f"eval/{name}"] = sum(values)
    return sums, len(rows)
