"""Batches sampled by an older policy (asynchronous runs, algorithm.max_staleness >= 1).

The learner scores a stale batch with the policy it holds now and trains against those
log-probs (the clipped ratio then starts at 1, as for a fresh batch). The sampling policy's
log-probs (the engine's) tell how far the sample is from what the current policy would draw:

- "tis": each token's advantage is weighed by the truncated importance ratio
  min(pi_current / pi_sampling, bound), which corrects the gradient's expectation towards the
  current policy with a bounded variance;
- "drop": sequences where a token's ratio leaves [1 / bound, bound] are dropped (advantage 0: the
  learner skips them, their tokens still count in the loss normalization); the others train
  unweighted.
"""

from __future__ import annotations

import math

import torch

from rollout.runtime.online.batches import RolloutBatch, pad_for_learner, unpad_left


def correct_stale(
    batch: RolloutBatch, current: list[list[float]], mode: str, bound: float
) -> tuple[RolloutBatch, dict[str, float]]:
    """`batch` with `current` ([B][completion_len_i]: the current policy's log-probs of its
    tokens) as its old log-probs and per-token advantages weighed ("tis") or dropped ("drop");
    and the metrics of the correction."""
    if mode not in ("tis", "drop"):
        raise ValueError(f"unknown stale_samples mode {mode!r}")
    per_token = batch.token_advantages
    sequence = batch.advantages.tolist()
    weighted: list[list[float]] = []
    weights_sum = tokens = truncated = dropped = 0
    for i, (now, then) in enumerate(zip(current, batch.old_logprobs, strict=True)):
        ratios = [math.exp(a - b) for a, b in zip(now, then, strict=True)]
        advantages = per_token[i] if per_token is not None else [sequence[i]] * len(now)
        if mode == "tis":
            weights = [min(r, bound) for r in ratios]
            truncated += sum(r > bound for r in ratios)
        else:
            keep = all(1 / bound <= r <= bound for r in ratios)
            weights = [1.0 if keep else 0.0] * len(ratios)
            dropped += not keep
        weighted.append([a * w for a, w in zip(advantages, weights, strict=True)])
        weights_sum += sum(weights)
        tokens += len(weights)
    corrected = RolloutBatch(
        prompt_ids=batch.prompt_ids,
        completion_ids=batch.completion_ids,
        old_logprobs=current,
        rewards=batch.rewards,
        advantages=batch.advantages,
        group_size=batch.group_size,
        policy_version=batch.policy_version,
        texts=batch.texts,
        token_advantages=weighted,
        old_values=batch.old_values,
        returns=batch.returns,
    )
    metrics = {"train/stale_weight_mean": weights_sum / max(1, tokens)}
    if mode == "tis":
        metrics["train/stale_truncated_fraction"] = truncated / max(1, tokens)
    else:
        metrics["train/stale_dropped_fraction"] = dropped / max(1, len(batch))
    return corrected, metrics


def current_logprobs(learner, batch: RolloutBatch, micro_batch_size: int) -> list[list[float]]:
    """[B][completion_len_i]: the learner's policy's log-probs of the batch's tokens, now."""
    rows: list[list[float]] = []
    with torch.no_grad():
        for start in range(0, len(batch), micro_batch_size):
            micro = batch.select(list(range(start, min(len(batch), start + micro_batch_size))))
            padded = pad_for_learner(micro, learner.pad_token_id, learner.device)
            scores = learner.completion_logprobs(learner.model, micro, padded)
            rows += unpad_left(scores, [len(c) for c in micro.completion_ids])
    return rows
