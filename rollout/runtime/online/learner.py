"""The learner role: turns a scored rollout batch into optimizer steps.

Minibatches and micro batches follow the plan; gradients of micro batches accumulate so that
every loss-aggregation mode gives the same gradient as one pass over the whole minibatch; with
several data-parallel ranks the gradients are averaged before the step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from rollout.algorithms.losses import entropy_from_logits, grpo_loss, token_logprobs
from rollout.runtime import transport
from rollout.runtime.online.batches import PaddedBatch, RolloutBatch, pad_for_learner
from rollout.runtime.online.critic import Critic
from rollout.runtime.online.shared_prefix import (
    shared_prefix_logprobs,
    shares_prompts,
    supports_shared_prefix,
)


@dataclass(frozen=True)
class LearnerKnobs:
    minibatch_size: int
    """Completions per optimizer step on this rank."""
    micro_batch_size: int
    update_epochs: int
    clip_ratio_low: float
    clip_ratio_high: float
    kl_coef: float
    kl_estimator: str
    loss_aggregation: str
    max_grad_norm: float | None
    temperature: float
    max_new_tokens: int


class Learner:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        knobs: LearnerKnobs,
        *,
        pad_token_id: int,
        device: str,
        reference: torch.nn.Module | None = None,
        critic: Critic | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.knobs = knobs
        self.pad_token_id = pad_token_id
        self.device = device
        self.reference = reference
        self.critic = critic
        self.optimizer_steps = 0

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Update epochs x minibatches of optimizer steps; returns mean metrics over them."""
        self.model.train()
        knobs = self.knobs
        totals: dict[str, float] = defaultdict(float)
        steps = 0
        for _ in range(knobs.update_epochs):
            for start in range(0, len(batch), knobs.minibatch_size):
                minibatch = batch.select(list(range(start, start + knobs.minibatch_size)))
                for name, value in self._optimizer_step(minibatch).items():
                    totals[name] += value
                steps += 1
        return {name: value / steps for name, value in totals.items()}

    def _optimizer_step(self, minibatch: RolloutBatch) -> dict[str, float]:
        knobs = self.knobs
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = self._token_count(minibatch)
        metrics: dict[str, float] = defaultdict(float)
        computed: list[dict[str, float]] = []
        skipped = 0
        for start in range(0, len(minibatch), knobs.micro_batch_size):
            micro = minibatch.select(list(range(start, start + knobs.micro_batch_size)))
            rows = self._rows_with_gradient(micro)
            skipped += len(micro) - len(rows)
            if not rows:
                continue
            micro = micro.select(rows) if len(rows) < len(micro) else micro
            padded = pad_for_learner(micro, self.pad_token_id, self.device)
            loss, stats = self._loss(micro, padded, total_tokens, len(minibatch))
            if self.critic is not None:
                share = micro.num_completion_tokens / total_tokens
                critic_loss, critic_stats = self.critic.loss(padded, share)
                stats = {**stats, **critic_stats}
                if self.critic.shares_policy:  # value head: one backward trains both
                    loss = loss + critic_loss
                else:
                    critic_loss.backward()
            loss.backward()
            # The micro batches' losses are parts of the minibatch's: their sum is its loss.
            metrics["loss"] += loss.item()
            computed.append(stats)
        for stats in computed:
            for name, value in stats.items():
                metrics[name] += value / len(computed)
        metrics["skipped_fraction"] = skipped / len(minibatch)
        self._fill_missing_gradients()
        transport.average_gradients(self._trained_parameters())
        metrics["grad_norm"] = self._clip()
        if self.critic is not None and not self.critic.shares_policy:
            transport.average_gradients(list(self.critic.model.parameters()))
            metrics["critic_grad_norm"] = self.critic.step()
        self.optimizer.step()
        # Gradients are dead weight until the next backward: freed now, the generation that
        # comes next runs without them (for a 135M-parameter model, 0.5 GB less at its peak).
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.optimizer_steps += 1
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def _rows_with_gradient(self, micro: RolloutBatch) -> list[int]:
        """The rows whose loss can have a gradient. With no KL term and no critic, a completion
        whose advantage is 0 (every token's, for per-token advantages) contributes exactly 0 to
        the policy loss of every aggregation, so its forward and backward are skipped: in GRPO
        every group whose completions scored alike. The token counts that normalize the loss
        still include it, so the update is the one the whole batch gives."""
        everything = list(range(len(micro)))
        if self.critic is not None or (self.reference is not None and self.knobs.kl_coef > 0):
            return everything
        if micro.token_advantages is not None:
            return [i for i in everything if any(a != 0 for a in micro.token_advantages[i])]
        return [i for i in everything if micro.advantages[i].item() != 0]

    def _fill_missing_gradients(self) -> None:
        """Zero gradients where no backward reached (every row skipped): AdamW then still moves
        its moments and decays the weights as for a zero gradient, and data-parallel ranks all
        reduce the same tensors."""
        for param in self._trained_parameters():
            if param.grad is None and param.requires_grad:
                param.grad = torch.zeros_like(param)

    def _loss(
        self, micro: RolloutBatch, padded: PaddedBatch, total_tokens: float, minibatch_size: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        knobs = self.knobs
        # The entropy is reported, not optimized: one more pass over the completion logits.
        logprobs, entropy = self._scores(self.model, micro, padded, entropy=True)
        ref_logprobs = None
        if self.reference is not None and knobs.kl_coef > 0:
            with torch.no_grad():
                ref_logprobs = self.completion_logprobs(self.reference, micro, padded)
        mode, scale = _accumulating(knobs.loss_aggregation, len(padded.advantages), minibatch_size)
        loss, stats = grpo_loss(
            logprobs,
            padded.old_logprobs,
            padded.advantages,
            padded.completion_mask,
            ref_logprobs=ref_logprobs,
            clip_low=knobs.clip_ratio_low,
            clip_high=knobs.clip_ratio_high,
            kl_coef=knobs.kl_coef,
            kl_estimator=knobs.kl_estimator,
            aggregation=mode,
            total_tokens=total_tokens,
            num_sequences=minibatch_size,
            max_new_tokens=knobs.max_new_tokens,
            entropy=entropy,
        )
        return loss * scale, stats

    def completion_logprobs(
        self, model: torch.nn.Module, micro: RolloutBatch, padded: PaddedBatch
    ) -> torch.Tensor:
        """[B, K] log-probs of the completion tokens; vocabulary logits only where needed, and
        a prompt shared by several completions run once (rollout.runtime.online.shared_prefix)."""
        return self._scores(model, micro, padded, entropy=False)

    def _scores(
        self, model: torch.nn.Module, micro: RolloutBatch, padded: PaddedBatch, *, entropy: bool
    ) -> Any:
        """completion_logprobs, and with `entropy` the entropy at each position too (a pair)."""
        if shares_prompts(micro) and supports_shared_prefix(model):
            return shared_prefix_logprobs(
                model,
                micro,
                pad_token_id=self.pad_token_id,
                device=self.device,
                temperature=self.knobs.temperature,
                entropy=entropy,
            )
        logits = model(
            input_ids=padded.input_ids,
            attention_mask=padded.attention_mask,
            position_ids=padded.position_ids,
            logits_to_keep=padded.logits_to_keep,
        ).logits[:, :-1]
        logprobs = token_logprobs(logits, padded.targets, self.knobs.temperature)
        if not entropy:
            return logprobs
        with torch.no_grad():
            return logprobs, entropy_from_logits(logits.detach(), self.knobs.temperature)

    def _token_count(self, minibatch: RolloutBatch) -> float:
        """Completion tokens the loss is normalized by: this rank's minibatch, or, for
        batch_token_mean, the minibatch across every data-parallel rank (divided by the ranks,
        since their gradients are averaged)."""
        tokens = float(minibatch.num_completion_tokens)
        if self.knobs.loss_aggregation == "batch_token_mean":
            tokens = transport.average_token_count(tokens)
        return max(1.0, tokens)

    def _trained_parameters(self) -> list[torch.Tensor]:
        """What the optimizer steps: the policy's parameters, and a value head's with them."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _clip(self) -> float:
        params = [p for p in self._trained_parameters() if p.grad is not None]
        limit = self.knobs.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, limit if limit is not None else float("inf"))
        return float(norm)


def _accumulating(mode: str, micro_size: int, minibatch_size: int) -> tuple[str, float]:
    """The aggregation to run on one micro batch, and its weight, such that the micro batches'
    gradients sum to the gradient of ``mode`` over the whole minibatch."""
    if mode == "token_mean":  # a token mean over the minibatch: normalize by its token count
        return "batch_token_mean", 1.0
    if mode == "sequence_mean":
        return mode, micro_size / minibatch_size
    return mode, 1.0  # batch_token_mean and constant already take whole-batch counts
