"""Per-token advantages for a scored rollout batch (PPO, REINFORCE++), between actor and learner.

GRPO and RLOO need nothing here: the actor's sequence advantages are final. PPO and REINFORCE++
need forwards the actor does not run (the reference's log-probs for the KL-shaped reward, the
critic's values), over the whole rollout batch, before the learner splits it into minibatches:
whitening is over the whole batch. The maths is in rollout.algorithms.advantages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rollout.algorithms.advantages import gae, kl_shaped_rewards, reinforce_pp_advantages, whiten
from rollout.algorithms.losses import kl_penalty, masked_mean
from rollout.runtime.online.batches import PaddedBatch, RolloutBatch, pad_for_learner, unpad_left
from rollout.runtime.online.critic import Critic

# (model, the rollout batch, the same batch padded) -> [B, K] completion log-probs, no grad
LogprobFn = Callable[[torch.nn.Module, RolloutBatch, PaddedBatch], torch.Tensor]


@dataclass
class TokenAdvantages:
    """Scores a rollout batch with per-token advantages: `kind` is "ppo" or "reinforce_pp"."""

    kind: str
    logprobs: LogprobFn
    pad_token_id: int
    device: str
    reference: torch.nn.Module | None
    kl_coef: float
    kl_in_reward: bool
    """Whether the KL to the reference goes into the token rewards (else the learner's loss)."""
    gamma: float
    lam: float = 1.0
    critic: Critic | None = None
    whiten_advantages: bool = True
    baseline: str = "none"

    def __call__(self, batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        padded = pad_for_learner(batch, self.pad_token_id, self.device)
        mask = padded.completion_mask
        kl = self._kl(batch, padded)
        lengths = [len(c) for c in batch.completion_ids]
        metrics: dict[str, float] = {}
        if kl is not None:
            metrics["train/reward_kl"] = masked_mean(kl, mask).item()
        rewards = batch.rewards.to(device=self.device, dtype=torch.float32)
        if self.kind == "reinforce_pp":
            advantages = reinforce_pp_advantages(
                rewards,
                kl,
                mask,
                kl_coef=self.kl_coef,
                gamma=self.gamma,
                group_size=batch.group_size,
                baseline=self.baseline,  # type: ignore[arg-type]
            )
            scored = replace(batch, token_advantages=unpad_left(advantages, lengths))
            return scored, metrics
        if self.critic is None:
            raise ValueError(f"{self.kind} needs a critic to score its batch")
        values = self.critic.values(padded)
        token_rewards = kl_shaped_rewards(rewards, kl, mask, kl_coef=self.kl_coef)
        advantages, returns = gae(token_rewards, values, mask, gamma=self.gamma, lam=self.lam)
        if self.whiten_advantages:
            advantages = whiten(advantages, mask)
        scored = replace(
            batch,
            token_advantages=unpad_left(advantages, lengths),
            old_values=unpad_left(values, lengths),
            returns=unpad_left(returns, lengths),
        )
        return scored, metrics

    def _kl(self, batch: RolloutBatch, padded: PaddedBatch) -> torch.Tensor | None:
        """k1 KL of the sampling policy to the reference per token (the classic reward penalty),
        or None when it does not go into the reward."""
        if not (self.kl_in_reward and self.kl_coef > 0 and self.reference is not None):
            return None
        with torch.no_grad():
            reference = self.logprobs(self.reference, batch, padded)
        return kl_penalty(padded.old_logprobs, reference, "k1") * padded.completion_mask
