"""Held-out evaluation: one greedy completion per prompt (or run.eval_samples sampled ones),
scored by the run's rewards."""

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
    *,
    samples: int = 1,
    seed: int | None = None,
) -> tuple[dict[str, float], int]:
    """Summed rewards (total and per function) of the completions on ``rows``, and how many
    completions they cover. Sums, not means: ranks evaluate shards of different sizes, so the
    means are taken over every rank's sums and counts (rollout.runtime.recording.record_means).

    One greedy completion per row, or with ``samples`` > 1 that many sampled as the run samples
    (generation's temperature, top_p, top_k) on ``seed``: their mean is the sampled policy's
    held-out reward."""
    names = ["eval/reward", *(f"eval/{f.name}" for f in rewards.functions)]
    if not rows:  # a rank with no share of a small eval set still takes part in the reduction
        return dict.fromkeys(names, 0.0), 0
    prompts = [prompt_format.prompt_text(row) for row in rows]
    stop = tuple(generation.stop)
    if samples == 1:
        params = SamplingParams(
            max_new_tokens=generation.max_new_tokens, temperature=0.0, stop=stop, n=1
        )
    else:
        params = SamplingParams(
            max_new_tokens=generation.max_new_tokens,
            temperature=generation.temperature,
            top_p=generation.top_p,
            top_k=generation.top_k,
            stop=stop,
            n=samples,
            seed=seed,
        )
    completions = engine.generate([prompt_format.encode(p) for p in prompts], params)
    # Completions come grouped by prompt: prompt 0's `samples` first.
    repeated = [i for i in range(len(rows)) for _ in range(samples)]
    scores = rewards.score(
        [prompts[i] for i in repeated],
        [c.text for c in completions],
        [prompt_format.reward_row(rows[i]) for i in repeated],
    )
    sums = {"eval/reward": sum(scores.total)}
    for name, values in scores.per_function.items():
        sums[f"eval/{name}"] = sum(values)
    return sums, len(repeated)
