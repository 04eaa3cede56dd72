"""The critic role (PPO): a value for every completion token, and its training.

Two shapes, by `algorithm.critic`:
- "separate": a copy of the policy's transformer (without its vocabulary head) under a scalar
  head, with its own AdamW at `critic_lr`. Twice the trainable weights, no interference.
- "value_head": a scalar head on the policy's own transformer. The head's parameters join the
  policy's optimizer, and the value loss (times vf_coef) is added to the policy loss, so one
  backward trains both; the trunk then runs twice per micro batch (once for logits, once for
  values), which keeps the policy's forward untouched.

Values line up with the learner's layout: V[:, k] is the value of the state before completion
token k, read from the hidden state at the position whose logits predict that token.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from rollout.algorithms.losses import value_loss
from rollout.runtime.online.batches import PaddedBatch


class ValueModel(torch.nn.Module):
    """A transformer trunk and a linear head to one scalar per position."""

    def __init__(self, trunk: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = torch.nn.Linear(hidden_size, 1)
        # Zero values to start with: the first advantages are then the plain returns, not noise.
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, padded: PaddedBatch) -> torch.Tensor:
        """[B, K] values of the completion positions (K = padded.targets.shape[1])."""
        hidden = self.trunk(
            input_ids=padded.input_ids,
            attention_mask=padded.attention_mask,
            position_ids=padded.position_ids,
        ).last_hidden_state
        width = padded.targets.shape[1]
        return self.head(hidden[:, -width - 1 : -1]).squeeze(-1).float()


@dataclass
class Critic:
    model: ValueModel
    optimizer: torch.optim.Optimizer | None
    """None when the critic shares the policy's optimizer (value_head)."""
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    vf_coef: float
    value_clip: float | None
    max_grad_norm: float | None

    @property
    def shares_policy(self) -> bool:
        return self.optimizer is None

    @torch.no_grad()
    def values(self, padded: PaddedBatch) -> torch.Tensor:
        """[B, K] values without gradient (scoring a fresh batch)."""
        was_training = self.model.training
        self.model.eval()
        try:
            return self.model(padded) * padded.completion_mask
        finally:
            self.model.train(was_training)

    def loss(
        self, padded: PaddedBatch, weight: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """vf_coef * the value loss of this micro batch, times `weight` (its share of the
        minibatch's tokens, so micro batches sum to the minibatch's token mean)."""
        if padded.old_values is None or padded.returns is None:
            raise ValueError("the batch has no old values or returns: it was not scored for PPO")
        values = self.model(padded)
        loss, stats = value_loss(
            values,
            padded.old_values,
            padded.returns,
            padded.completion_mask,
            clip=self.value_clip,
        )
        return self.vf_coef * loss * weight, stats

    def step(self) -> torch.Tensor:
        """Clip and apply the critic's own gradients (separate critic only); its grad norm (on
        the device: read with the learner's other metrics)."""
        assert self.optimizer is not None and self.scheduler is not None
        params = [p for p in self.model.parameters() if p.grad is not None]
        limit = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, limit)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return norm


def value_model_for(policy: torch.nn.Module, *, separate: bool) -> ValueModel:
    """A ValueModel over a copy of the policy's trunk (separate) or over the trunk itself."""
    trunk = policy.base_model  # transformers: the model without its vocabulary head
    if separate:
        trunk = copy.deepcopy(trunk)
    hidden = policy.config.hidden_size
    model = ValueModel(trunk, hidden).to(
        device=next(policy.parameters()).device, dtype=next(policy.parameters()).dtype
    )
    return model
