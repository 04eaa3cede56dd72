"""The actor role: prompts in, a scored rollout batch out (generate, reward, advantage)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import torch

from rollout.engines.base import Completion, Engine, SamplingParams
from rollout.harness.reward_runner import RewardRunner
from rollout.runtime.online.batches import RolloutBatch, Sample
from rollout.tracing import span

Row = Mapping[str, Any]


@dataclass(frozen=True)
class PromptFormat:
    """How a dataset row becomes prompt token ids, and which fields rewards see."""

    encode: Callable[[str], list[int]]
    """Prompt text -> token ids, chat template applied."""
    prompt_field: str
    role_fields: Mapping[str, str]
    """Role name -> record field (e.g. answer -> solution), so rewards can ask for `answer`."""

    def prompt_text(self, row: Row) -> str:
        return str(row[self.prompt_field])

    def reward_row(self, row: Row) -> dict[str, Any]:
        """The record's fields, and each mapped role under its own name: a role the config maps
        (answer -> solution) wins over a record field that happens to share the role's name."""
        fields = dict(row)
        for role, field in self.role_fields.items():
            fields[role] = row.get(field)
        return fields


@dataclass
class Rollout:
    batch: RolloutBatch
    metrics: dict[str, float]
    samples: list[Sample] = dataclass_field(default_factory=list)
    """Every completion's (or episode's) text and reward, in batch order."""


class Actor:
    def __init__(
        self,
        engine: Engine,
        prompt_format: PromptFormat,
        rewards: RewardRunner,
        advantage: Callable[[torch.Tensor, int], torch.Tensor],
        params: SamplingParams,
    ):
        self.engine = engine
        self.format = prompt_format
        self.rewards = rewards
        self.advantage = advantage
        self.params = params
        self._encoded: dict[str, list[int]] = {}

    def rollout(self, rows: Sequence[Row], *, seed: int) -> Rollout:
        """Sample ``params.n`` completions per row, score them, compute advantages."""
        prompts = [self.format.prompt_text(row) for row in rows]
        prompt_ids = [self._encode(text) for text in prompts]
        params = SamplingParams(**{**self.params.__dict__, "seed": seed})
        started = time.perf_counter()
        with span("generate"):
            completions = self.engine.generate(prompt_ids, params)
        generate_s = time.perf_counter() - started

        scoring_started = time.perf_counter()
        group = params.n
        owners = [c.prompt_index for c in completions]
        texts = [c.text for c in completions]
        with span("score"):
            scores = self.rewards.score(
                [prompts[i] for i in owners],
                texts,
                [self.format.reward_row(rows[i]) for i in owners],
            )
        rewards = torch.tensor(scores.total, dtype=torch.float32, device="cpu")
        batch = RolloutBatch(
            prompt_ids=[prompt_ids[i] for i in owners],
            completion_ids=[c.token_ids for c in completions],
            old_logprobs=[c.logprobs for c in completions],
            rewards=rewards,
            advantages=self.advantage(rewards, group).float(),
            group_size=group,
            policy_version=self.engine.policy_version,
            texts=texts,
        )
        metrics = _rollout_metrics(completions, rewards, scores.per_function, generate_s)
        for function in self.rewards.functions:  # on_error = "fail_sample": how many it failed
            if function.on_error == "fail_sample":
                failed = scores.failed.get(function.name, {})
                metrics[f"reward/{function.name}/failed"] = float(len(failed))
        # Rewards and advantages are host work: the host clock is right for them.
        metrics["perf/score_s"] = time.perf_counter() - scoring_started
        samples = [
            Sample(
                prompt=prompts[c.prompt_index],
                completion=c.text,
                turns=None,
                reward=scores.total[i],
                extra={
                    "finish_reason": c.finish_reason,
                    "tokens": len(c.token_ids),
                    "rewards": {name: values[i] for name, values in scores.per_function.items()},
                    **_failures_of(scores.failed, i),
                },
            )
            for i, c in enumerate(completions)
        ]
        return Rollout(batch=batch, metrics=metrics, samples=samples)

    def _encode(self, text: str) -> list[int]:
        if text not in self._encoded:
            self._encoded[text] = self.format.encode(text)
        return self._encoded[text]


def _failures_of(failed: Mapping[str, Mapping[int, str]], i: int) -> dict[str, Any]:
    """Why rewards failed on sample i (scored their failure_score), for its record; {} if none."""
    reasons = {name: lost[i] for name, lost in failed.items() if i in lost}
    return {"reward_failures": reasons} if reasons else {}


def _rollout_metrics(
    completions: list[Completion],
    rewards: torch.Tensor,
    per_function: Mapping[str, Sequence[float]],
    generate_s: float,
) -> dict[str, float]:
    tokens = sum(len(c.token_ids) for c in completions)
    finish = Counter(c.finish_reason for c in completions)
    metrics = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "completion/tokens_mean": tokens / max(1, len(completions)),
        "completion/stopped_fraction": (finish["eos"] + finish["stop"]) / max(1, len(completions)),
        "perf/generate_s": generate_s,
        "perf/generated_tokens": float(tokens),
    }
    for name, values in per_function.items():
        metrics[f"reward/{name}"] = sum(values) / max(1, len(values))
    return metrics
