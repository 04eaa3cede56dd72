"""Held-out evaluation: one greedy completion per prompt, scored by the run's rewards."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout.engines.base import Engine, SamplingParams
from rollout.harness.reward_runner import RewardRunner
from rollout.runtime.actor import PromptFormat


def evaluate(
    engine: Engine,
    prompt_format: PromptFormat,
    rewards: RewardRunner,
    rows: Sequence[Mapping[str, Any]],
    generation: Any,
) -> dict[str, float]:
    """Mean reward (total and per function) of greedy completions on ``rows``."""
    prompts = [prompt_format.prompt_text(row) for row in rows]
    params = SamplingParams(
        max_new_tokens=generation.max_new_tokens, temperature=0.0, stop=tuple(generation.stop), n=1
    )
    completions = engine.generate([prompt_format.encode(p) for p in prompts], params)
    scores = rewards.score(
        prompts, [c.text for c in completions], [prompt_format.reward_row(row) for row in rows]
    )
    count = max(1, len(rows))
    metrics = {"eval/reward": sum(scores.total) / count}
    for name, values in scores.per_function.items():
        metrics[f"eval/{name}"] = sum(values) / count
    return metrics
