"""Batches sampled by an older policy (asynchronous runs, algorithm.max_staleness >= 1).

The correction happens inside the learner's loss, from the log-probs its own forward computes
(no extra scoring pass): for a stale batch the learner takes the detached log-probs of the policy
it is training, at the minibatch it is on, as the "old" log-probs of the clipped ratio (which then
starts at 1, as for a fresh batch): the proximal policy is the one being trained (AReaL's
decoupled objective). The sampling policy's log-probs (the engine's, which the batch carries) tell
how far the sample is from what that policy would draw
(rollout.algorithms.losses.stale_correction):

- "tis": each token's advantage is weighed by the truncated importance ratio
  min(pi_current / pi_sampling, bound), which corrects the gradient's expectation towards the
  current policy with a bounded variance;
- "drop": sequences where a token's ratio leaves [1 / bound, bound] are dropped (advantage 0;
  their tokens still count in the loss normalization); the others train unweighted.

With one update epoch and one minibatch per step, pi_current is the policy the step started
from; with several minibatches (or epochs) it is the policy as it stands at each minibatch.
"""

from __future__ import annotations

from dataclasses import dataclass

STALE_MODES = ("tis", "drop")


@dataclass(frozen=True)
class StaleCorrection:
    """How the learner corrects one stale batch: algorithm.stale_samples and tis_bound."""

    mode: str
    bound: float

    def __post_init__(self) -> None:
        if self.mode not in STALE_MODES:
            raise ValueError(f"unknown stale_samples mode {self.mode!r}; choose one of tis, drop")
        if not self.bound >= 1:
            raise ValueError(f"tis_bound must be >= 1, got {self.bound}")
