"""The learner role: turns a scored rollout batch into optimizer steps.

Minibatches and micro batches follow the plan; gradients of micro batches accumulate so that
every loss-aggregation mode gives the same gradient as one pass over the whole minibatch; with
several data-parallel ranks the gradients are averaged before the step.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch

from rollout.algorithms.losses import grpo_loss, read_metrics, stale_correction
from rollout.runtime import transport
from rollout.runtime.logprobs import final_states, token_scores
from rollout.runtime.online.batches import PaddedBatch, RolloutBatch, pad_for_learner
from rollout.runtime.online.critic import Critic
from rollout.runtime.online.shared_prefix import (
    shared_prefix_logprobs,
    shares_prompts,
    supports_shared_prefix,
)
from rollout.runtime.online.staleness import StaleCorrection
from rollout.runtime.precision import autocast
from rollout.runtime.sharding import is_sharded


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
    autocast_dtype: str | None = None
    """The dtype forward passes autocast to (model.precision = "autocast"); None: none."""
    minibatches: int | None = None
    """Optimizer steps per epoch, whatever the batch's size: a batch of agent episodes holds one
    row per stretch of conversation, a number that varies, while every learner must step the
    planned number of times (its scheduler's, and its peers' collectives). The rows are split
    into this many near-equal minibatches. None: minibatches of minibatch_size rows."""


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

    def update(self, batch: RolloutBatch, stale: StaleCorrection | None = None) -> dict[str, float]:
        """Update epochs x minibatches of optimizer steps; returns mean metrics over them.

        `stale`: the batch was sampled by an older policy (rollout.runtime.online.staleness).
        Each minibatch then takes the detached log-probs of the policy being trained as the
        clipped ratio's old log-probs (the proximal policy is the one being trained, as in
        AReaL's decoupled objective) and weighs its advantages against the engine's log-probs
        the batch carries; the correction's metrics are averaged over the minibatches.

        The metrics stay on the device until every step is done and are then read at once: no
        step waits for the device to report a number (which on a GPU would stall the queue of
        kernels at every micro batch)."""
        self.model.train()
        knobs = self.knobs
        totals: dict[str, torch.Tensor | float] = {}
        steps = 0
        for _ in range(knobs.update_epochs):
            for rows in _minibatch_rows(len(batch), knobs):
                minibatch = batch.select(rows)
                for name, value in self._optimizer_step(minibatch, stale).items():
                    totals[name] = totals.get(name, 0.0) + value
                steps += 1
        return {name: value / steps for name, value in read_metrics(totals).items()}

    def _optimizer_step(
        self, minibatch: RolloutBatch, stale: StaleCorrection | None
    ) -> dict[str, torch.Tensor | float]:
        knobs = self.knobs
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = self._token_count(minibatch)
        loss_sum: torch.Tensor | float = 0.0
        stats_sum: dict[str, torch.Tensor] = {}
        computed = skipped = 0
        advantages = _host_values(minibatch.advantages)
        for start in range(0, len(minibatch), knobs.micro_batch_size):
            end = min(len(minibatch), start + knobs.micro_batch_size)
            micro = minibatch.select(list(range(start, end)))
            rows = self._rows_with_gradient(
                micro, advantages[start : start + knobs.micro_batch_size]
            )
            skipped += len(micro) - len(rows)
            if not rows:
                continue
            micro = micro.select(rows) if len(rows) < len(micro) else micro
            padded = pad_for_learner(micro, self.pad_token_id, self.device)
            with self._autocast():
                loss, stats = self._loss(micro, padded, total_tokens, len(minibatch), stale)
                critic_loss = None
                if self.critic is not None:
                    share = micro.num_completion_tokens / total_tokens
                    critic_loss, critic_stats = self.critic.loss(padded, share)
                    stats = {**stats, **critic_stats}
            if critic_loss is not None:
                if self.critic is not None and self.critic.shares_policy:
                    loss = loss + critic_loss  # value head: one backward trains both
                else:
                    critic_loss.backward()
            loss.backward()
            # The micro batches' losses are parts of the minibatch's: their sum is its loss.
            loss_sum = loss_sum + loss.detach()
            for name, value in stats.items():
                stats_sum[name] = stats_sum[name] + value if name in stats_sum else value
            computed += 1
        metrics: dict[str, torch.Tensor | float] = {"loss": loss_sum}
        metrics.update({name: value / computed for name, value in stats_sum.items()})
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

    def _rows_with_gradient(self, micro: RolloutBatch, advantages: list[float]) -> list[int]:
        """The rows whose loss can have a gradient. With no KL term and no critic, a completion
        whose advantage is 0 (every token's, for per-token advantages) contributes exactly 0 to
        the policy loss of every aggregation, so its forward and backward are skipped: in GRPO
        every group whose completions scored alike. The token counts that normalize the loss
        still include it, so the update is the one the whole batch gives. Decided from host
        data (`advantages`: the micro batch's sequence advantages, read once per minibatch), so
        it never waits for the device."""
        everything = list(range(len(micro)))
        if self.critic is not None or (self.reference is not None and self.knobs.kl_coef > 0):
            return everything
        if is_sharded(self.model):
            # Each forward and backward of a sharded model is a collective over the learners:
            # every learner must run the same micro batches, whatever its advantages.
            return everything
        if micro.token_advantages is not None:
            return [i for i in everything if any(a != 0 for a in micro.token_advantages[i])]
        return [i for i in everything if advantages[i] != 0]

    def _fill_missing_gradients(self) -> None:
        """Zero gradients where no backward reached (every row skipped): AdamW then still moves
        its moments and decays the weights as for a zero gradient, and data-parallel ranks all
        reduce the same tensors."""
        for param in self._trained_parameters():
            if param.grad is None and param.requires_grad:
                param.grad = torch.zeros_like(param)

    def _loss(
        self,
        micro: RolloutBatch,
        padded: PaddedBatch,
        total_tokens: float,
        minibatch_size: int,
        stale: StaleCorrection | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        knobs = self.knobs
        # The entropy is reported, not optimized: the chunked head computes it on the way.
        logprobs, entropy = self._scores(self.model, micro, padded, entropy=True)
        old_logprobs, advantages, stale_stats = padded.old_logprobs, padded.advantages, {}
        if stale is not None:
            old_logprobs, advantages, stale_stats = _corrected(logprobs, padded, stale)
        ref_logprobs = None
        if self.reference is not None and knobs.kl_coef > 0:
            with torch.no_grad():
                ref_logprobs = self.completion_logprobs(self.reference, micro, padded)
        mode, scale = _accumulating(knobs.loss_aggregation, len(padded.advantages), minibatch_size)
        loss, stats = grpo_loss(
            logprobs,
            old_logprobs,
            advantages,
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
        return loss * scale, {**stats, **stale_stats}

    def completion_logprobs(
        self, model: torch.nn.Module, micro: RolloutBatch, padded: PaddedBatch
    ) -> torch.Tensor:
        """[B, K] log-probs of the completion tokens; vocabulary logits only where needed, and
        a prompt shared by several completions run once (rollout.runtime.online.shared_prefix)."""
        with self._autocast():
            return self._scores(model, micro, padded, entropy=False)[0]

    def _scores(
        self, model: torch.nn.Module, micro: RolloutBatch, padded: PaddedBatch, *, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """completion_logprobs, and with `entropy` the entropy at each position too."""
        if shares_prompts(micro) and supports_shared_prefix(model):
            return shared_prefix_logprobs(
                model,
                micro,
                pad_token_id=self.pad_token_id,
                device=self.device,
                temperature=self.knobs.temperature,
                entropy=entropy,
            )
        assert padded.completion_rows is not None
        states = final_states(
            model,
            keep=padded.logits_to_keep,
            input_ids=padded.input_ids,
            attention_mask=padded.attention_mask,
            position_ids=padded.position_ids,
            use_cache=False,
        )[:, :-1]
        return token_scores(
            model,
            states,
            padded.targets,
            padded.completion_rows,
            temperature=self.knobs.temperature,
            entropy=entropy,
        )

    def _autocast(self) -> contextlib.AbstractContextManager:
        """The forward passes' autocast (model.precision = "autocast"), or nothing."""
        return autocast(self.device, self.knobs.autocast_dtype)

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

    def _clip(self) -> torch.Tensor:
        """Clip the gradients; their norm before clipping, left on the device."""
        params = [p for p in self._trained_parameters() if p.grad is not None]
        limit = self.knobs.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, limit if limit is not None else float("inf"))
        return transport.local_value(norm)  # a sharded model's norm is a DTensor


def _corrected(
    logprobs: torch.Tensor, padded: PaddedBatch, stale: StaleCorrection
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """A stale micro batch's old log-probs and advantages [B, K] for the clipped loss, and the
    correction's metrics: the old log-probs are the trained policy's, detached (the ratio starts
    at 1; padding keeps the batch's), the advantages weighed against the engine's log-probs."""
    mask = padded.completion_mask
    weights, stats = stale_correction(logprobs, padded.old_logprobs, mask, stale.mode, stale.bound)
    old = torch.where(mask.bool(), logprobs.detach(), padded.old_logprobs)
    advantages = padded.advantages
    advantages = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    return old, advantages * weights, stats


def _minibatch_rows(size: int, knobs: LearnerKnobs) -> list[list[int]]:
    """The rows of each minibatch: consecutive runs of minibatch_size, or with `minibatches`
    that many near-equal runs (the same runs when size is minibatches x minibatch_size)."""
    if knobs.minibatches is None:
        step = knobs.minibatch_size
        return [list(range(start, min(size, start + step))) for start in range(0, size, step)]
    bounds = [size * i // knobs.minibatches for i in range(knobs.minibatches + 1)]
    return [list(range(lo, hi)) for lo, hi in itertools.pairwise(bounds) if hi > lo]


def _host_values(values: torch.Tensor) -> list[float]:
    """A rollout batch's [B] advantages as numbers: the actor makes them on the CPU, so this
    reads host memory (a tensor on a GPU would make every step wait here)."""
    if values.device.type != "cpu":
        raise ValueError(f"a rollout batch's advantages must be on the CPU, not {values.device}")
    return values.tolist()


def _accumulating(mode: str, micro_size: int, minibatch_size: int) -> tuple[str, float]:
    """The aggregation to run on one micro batch, and its weight, such that the micro batches'
    gradients sum to the gradient of ``mode`` over the whole minibatch."""
    if mode == "token_mean":  # a token mean over the minibatch: normalize by its token count
        return "batch_token_mean", 1.0
    if mode == "sequence_mean":
        return mode, micro_size / minibatch_size
    return mode, 1.0  # batch_token_mean and constant already take whole-batch counts
