"""Per-token advantages for a scored rollout batch (PPO, REINFORCE++), between actor and learner.

GRPO and RLOO need nothing here: the actor's sequence advantages are final. PPO and REINFORCE++
need forwards the actor does not run (the reference's log-probs for the KL-shaped reward, the
critic's values), over the whole rollout batch, before the learner splits it into minibatches:
whitening is over the whole batch. The maths is in rollout.algorithms.advantages; which kind uses
which scorer is in rollout.runtime.online.algorithms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from rollout.algorithms.advantages import gae, kl_shaped_rewards, reinforce_pp_advantages, whiten
from rollout.algorithms.losses import kl_penalty, masked_mean
from rollout.runtime.online.batches import (
    PaddedBatch,
    RolloutBatch,
    pad_for_learner,
    pad_left,
    unpad_left,
)
from rollout.runtime.online.critic import Critic

# (model, the rollout batch, the same batch padded) -> [B, K] completion log-probs, no grad
LogprobFn = Callable[[torch.nn.Module, RolloutBatch, PaddedBatch], torch.Tensor]


class TokenAdvantages(Protocol):
    def __call__(self, batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        """The batch with per-token advantages (and what else its learner reads), and metrics."""
        ...


@dataclass
class Prepared:
    """A batch ready to score per token (Scoring.prepare)."""

    padded: PaddedBatch
    kl: torch.Tensor | None
    """[B, K] the KL that goes into the token rewards, or None."""
    rewards: torch.Tensor
    """[B] each row's reward (an episode's return)."""
    placed: torch.Tensor | None
    """[B, K] per-turn rewards on their answers' last tokens (environment.advantage = "turn"),
    or None: `rewards` go on each row's last policy token."""
    metrics: dict[str, float]


@dataclass
class Scoring:
    """What scoring a batch per token takes, whatever the algorithm."""

    logprobs: LogprobFn
    pad_token_id: int
    device: str
    reference: torch.nn.Module | None
    kl_coef: float
    kl_in_reward: bool
    """Whether the KL to the reference goes into the token rewards (else the learner's loss)."""
    critic: Critic | None = None

    def prepare(self, batch: RolloutBatch) -> Prepared:
        """The batch padded, the per-token KL that goes into the rewards (or None), the rewards
        on the device (and a multi-turn episode's per-turn rewards on their tokens), and the
        KL's metric. The padded completion mask is the policy's tokens: a multi-turn episode's
        environment tokens are context, out of the KL, the rewards and the returns."""
        padded = pad_for_learner(batch, self.pad_token_id, self.device)
        kl = self._kl(batch, padded)
        metrics: dict[str, float] = {}
        if kl is not None:
            metrics["train/reward_kl"] = masked_mean(kl, padded.completion_mask).item()
        rewards = batch.rewards.to(device=self.device, dtype=torch.float32)
        placed = None
        if batch.token_rewards is not None:
            width = padded.completion_mask.shape[1]
            placed = pad_left(batch.token_rewards, width).to(self.device)
        return Prepared(padded, kl, rewards, placed, metrics)

    def _kl(self, batch: RolloutBatch, padded: PaddedBatch) -> torch.Tensor | None:
        """k1 KL of the sampling policy to the reference per token (the classic reward penalty),
        or None when it does not go into the reward."""
        if not (self.kl_in_reward and self.kl_coef > 0 and self.reference is not None):
            return None
        with torch.no_grad():
            reference = self.logprobs(self.reference, batch, padded)
        return kl_penalty(padded.old_logprobs, reference, "k1") * padded.completion_mask


@dataclass
class ReinforcePpAdvantages:
    """REINFORCE++: KL-shaped token rewards, their discounted returns whitened over the batch."""

    scoring: Scoring
    gamma: float
    baseline: str
    """"group" subtracts the mean reward of the prompt's completions first; "none" does not."""

    def __call__(self, batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        ready = self.scoring.prepare(batch)
        advantages = reinforce_pp_advantages(
            ready.rewards,
            ready.kl,
            ready.padded.completion_mask,
            kl_coef=self.scoring.kl_coef,
            gamma=self.gamma,
            group_size=batch.group_size,
            baseline=self.baseline,  # type: ignore[arg-type]
            placed=ready.placed,
        )
        scored = replace(batch, token_advantages=unpad_left(advantages, _lengths(batch)))
        return scored, ready.metrics


@dataclass
class GaeAdvantages:
    """PPO: the critic's values of the batch, and GAE advantages and returns from them and the
    KL-shaped token rewards."""

    scoring: Scoring
    gamma: float
    lam: float
    whiten: bool
    """Normalize the advantages to zero mean and unit std over the batch."""

    def __call__(self, batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        ready = self.scoring.prepare(batch)
        critic = self.scoring.critic
        if critic is None:
            raise ValueError("ppo needs a critic to score its batch")
        mask = ready.padded.completion_mask
        # The critic reads the whole sequence (the environment's messages too), valued at the
        # policy's tokens only.
        values = critic.values(ready.padded)
        token_rewards = kl_shaped_rewards(
            ready.rewards, ready.kl, mask, kl_coef=self.scoring.kl_coef, placed=ready.placed
        )
        advantages, returns = gae(token_rewards, values, mask, gamma=self.gamma, lam=self.lam)
        if self.whiten:
            advantages = whiten(advantages, mask)
        lengths = _lengths(batch)
        scored = replace(
            batch,
            token_advantages=unpad_left(advantages, lengths),
            old_values=unpad_left(values, lengths),
            returns=unpad_left(returns, lengths),
        )
        return scored, ready.metrics


def _lengths(batch: RolloutBatch) -> list[int]:
    return [len(c) for c in batch.completion_ids]
