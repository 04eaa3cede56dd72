"""The offline objectives behind one interface, looked up by algorithm kind (OBJECTIVES).

The loop (rollout.runtime.offline.loop) asks an objective to split a step's records into micro
batches, for each micro batch's loss, and to evaluate a split. The objective turns samples into
tensors (rollout.runtime.offline.batches), runs the model, and calls the pure maths of
rollout.algorithms. Every loss it returns is already weighed by its micro batch's share of the
step, and so are its metrics: the loop sums them over micro batches (and averages over ranks).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch

from rollout.algorithms.losses import masked_mean
from rollout.algorithms.preference import (
    dpo_loss,
    ipo_loss,
    kto_loss,
    kto_reference_point,
    sequence_logprobs,
)
from rollout.algorithms.reward_model import bradley_terry_loss
from rollout.algorithms.sft import IGNORE, sft_loss_from_logprobs
from rollout.harness.model_reward import reward_scores
from rollout.models.batches import CompletionBatch, pad_completions
from rollout.models.samples import Demonstration, Judged, Pair
from rollout.runtime import transport
from rollout.runtime.logprobs import final_states, token_scores
from rollout.runtime.offline.batches import TokenBatch, pack_sequences, pad_sequences
from rollout.runtime.offline.data import Split

Metrics = dict[str, float]


@dataclass
class Micro:
    """One forward/backward pass: the records it covers and what the objective prepared."""

    indices: list[int]
    share: float
    """Its part of the step: the loss and metrics are multiplied by it."""
    batch: Any = None


@dataclass
class StepBatches:
    micros: list[Micro]
    tokens: int = 0
    """Tokens the objective already ran through the model to prepare the step (KTO's KL pass)."""


@dataclass
class Context:
    """What every objective needs from the worker."""

    pad_id: int
    device: str
    algo: Any
    max_length: int
    reference: Reference | None = None


class Reference(Protocol):
    def sums(
        self, split: str, streams: tuple[str, ...], indices: list[int], batch: CompletionBatch
    ) -> torch.Tensor:
        """[len(streams) * len(indices)] sequence log-probs, streams-major (as the batch rows)."""
        ...


class Objective(Protocol):
    streams: tuple[str, ...]
    """The reference log-prob streams it reads ("chosen", ...); () when it has no reference."""

    def reference_sums(
        self, model: Any, split: Split, indices: list[int]
    ) -> dict[str, torch.Tensor]:
        """Each stream's [len(indices)] sequence log-probs under ``model``, batched as
        ``evaluate`` batches them (so a policy that is still its reference scores margins of
        exactly 0)."""
        ...

    def step_batches(
        self, model: Any, split: Split, indices: list[int], micro_size: int
    ) -> StepBatches: ...

    def loss(self, model: Any, split: Split, micro: Micro) -> tuple[torch.Tensor, Metrics, int]:
        """(weighted loss with grad, weighted metrics, tokens run through the model)."""
        ...

    def evaluate(self, model: Any, split: Split, chunk_size: int) -> Metrics: ...


# --- forward passes ------------------------------------------------------------------------------


def sequence_sums(model: Any, batch: CompletionBatch) -> torch.Tensor:
    """[B] summed log-probs of each row's completion; vocabulary logits only where needed."""
    return sequence_sums_and_entropy(model, batch, entropy=False)[0]


def sequence_sums_and_entropy(
    model: Any, batch: CompletionBatch, *, entropy: bool = True
) -> tuple[torch.Tensor, float | None]:
    """sequence_sums, and the policy's mean entropy over the completion tokens (reported, not
    optimized: no gradient; None when not asked for)."""
    states = final_states(
        model,
        keep=batch.logits_to_keep,
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )[:, :-1]
    logprobs, entropies = token_scores(
        model, states, batch.targets, batch.rows, temperature=1.0, entropy=entropy
    )
    sums = sequence_logprobs(logprobs, batch.mask)
    return sums, (None if entropies is None else float(masked_mean(entropies, batch.mask)))


def _chunks(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i : i + size] for i in range(0, len(indices), size)]


def _split_evenly(indices: list[int], size: int) -> list[Micro]:
    return [Micro(part, len(part) / len(indices)) for part in _chunks(indices, size)]


def _weighted(metrics: Mapping[str, float], share: float) -> Metrics:
    return {name: value * share for name, value in metrics.items()}


# --- DPO and IPO ---------------------------------------------------------------------------------


@dataclass
class PairPreference:
    """DPO or IPO: the policy's log-ratio margin between the chosen and the rejected completion."""

    ctx: Context
    loss_fn: Callable[..., tuple[torch.Tensor, Metrics]]
    average: bool
    """IPO: per-token mean log-probs rather than sums."""
    streams: tuple[str, ...] = ("chosen", "rejected")

    def reference_sums(self, model, split, indices):
        chosen, rejected = sequence_sums(model, self._batch(split, indices)).chunk(2)
        return {"chosen": chosen, "rejected": rejected}

    def step_batches(self, model, split, indices, micro_size):
        return StepBatches(_split_evenly(indices, micro_size))

    def loss(self, model, split, micro):
        policy, reference, batch, entropy = self._logprobs(
            model, split, micro.indices, entropy=True
        )
        loss, metrics = self.loss_fn(*policy.chunk(2), *reference.chunk(2))
        metrics = {**metrics, "entropy": entropy}
        return loss * micro.share, _weighted(metrics, micro.share), batch.tokens

    def evaluate(self, model, split, chunk_size):
        policy, reference = [], []
        with torch.no_grad():
            for part in _chunks(list(range(len(split))), chunk_size):
                p, r, _, _ = self._logprobs(model, split, part)
                policy.append(p.view(2, -1))
                reference.append(r.view(2, -1))
        p, r = torch.cat(policy, dim=1), torch.cat(reference, dim=1)
        return self.loss_fn(p[0], p[1], r[0], r[1])[1]

    def _batch(self, split, indices) -> CompletionBatch:
        """The pairs' prompt + chosen rows, then their prompt + rejected rows."""
        samples = [_pair(split, i) for i in indices]
        return pad_completions(
            [s.prompt for s in samples] * 2,
            [s.chosen for s in samples] + [s.rejected for s in samples],
            self.ctx.pad_id,
            self.ctx.device,
        )

    def _logprobs(self, model, split, indices, *, entropy: bool = False):
        batch = self._batch(split, indices)
        policy, mean_entropy = sequence_sums_and_entropy(model, batch, entropy=entropy)
        reference = self.ctx.reference.sums(split.name, self.streams, indices, batch)
        if self.average:
            lengths = batch.mask.sum(dim=-1).clamp(min=1)
            policy, reference = policy / lengths, reference / lengths
        return policy, reference, batch, mean_entropy


def _pair(split: Split, index: int) -> Pair:
    sample = split.samples[index]
    assert isinstance(sample, Pair)
    return sample


# --- KTO -----------------------------------------------------------------------------------------


@dataclass
class Kto:
    """KTO: each completion against the reference point z0, the batch's KL estimate."""

    ctx: Context
    streams: tuple[str, ...] = ("completion", "mismatched")
    _z0: torch.Tensor = field(default_factory=lambda: torch.zeros((), device="cpu"))

    def reference_sums(self, model, split, indices):
        return {
            stream: sequence_sums(model, self._batch(split, stream, indices))
            for stream in self.streams
        }

    def _batch(self, split, stream, indices) -> CompletionBatch:
        """prompt + completion rows ("completion"), or prompt + the next record's completion
        ("mismatched")."""
        samples = [_judged(split, i) for i in indices]
        if stream == "completion":
            completions = [s.completion for s in samples]
        else:
            assert split.mismatched is not None
            completions = [split.mismatched[i] for i in indices]
        prompts = [s.prompt for s in samples]
        return pad_completions(prompts, completions, self.ctx.pad_id, self.ctx.device)

    def step_batches(self, model, split, indices, micro_size):
        # z0 comes from the whole step (every rank's share), before any micro batch: so the
        # micro batches of a step share one reference point, as one pass over the step would.
        with torch.no_grad():
            policy, reference, tokens = self._mismatched(model, split, indices, micro_size)
        self._z0 = kto_reference_point(
            transport.gather_batch(policy), transport.gather_batch(reference)
        )
        return StepBatches(_split_evenly(indices, micro_size), tokens=tokens)

    def loss(self, model, split, micro):
        loss, metrics, batch = self._loss(model, split, micro.indices, self._z0)
        return loss * micro.share, _weighted(metrics, micro.share), batch.tokens

    def evaluate(self, model, split, chunk_size):
        indices = list(range(len(split)))
        with torch.no_grad():
            policy, reference, _ = self._mismatched(model, split, indices, chunk_size)
            z0 = kto_reference_point(policy, reference)
            parts = [self._completions(model, split, part) for part in _chunks(indices, chunk_size)]
        policy = torch.cat([p for p, _, _, _ in parts])
        reference = torch.cat([r for _, r, _, _ in parts])
        return self._call(split, indices, policy, reference, z0)[1]

    def _mismatched(self, model, split, indices, chunk_size):
        policy, reference, tokens = [], [], 0
        for part in _chunks(indices, chunk_size):
            batch = self._batch(split, "mismatched", part)
            policy.append(sequence_sums(model, batch))
            reference.append(self.ctx.reference.sums(split.name, ("mismatched",), part, batch))
            tokens += batch.tokens
        return torch.cat(policy), torch.cat(reference), tokens

    def _completions(self, model, split, indices, *, entropy: bool = False):
        batch = self._batch(split, "completion", indices)
        policy, mean_entropy = sequence_sums_and_entropy(model, batch, entropy=entropy)
        reference = self.ctx.reference.sums(split.name, ("completion",), indices, batch)
        return policy, reference, batch, mean_entropy

    def _loss(self, model, split, indices, z0):
        policy, reference, batch, entropy = self._completions(model, split, indices, entropy=True)
        loss, metrics = self._call(split, indices, policy, reference, z0)
        return loss, {**metrics, "entropy": entropy}, batch

    def _call(self, split, indices, policy, reference, z0):
        algo = self.ctx.algo
        desirable = torch.tensor(
            [_judged(split, i).desirable for i in indices], device=policy.device
        )
        return kto_loss(
            policy,
            reference,
            desirable,
            z0.to(policy.device),
            beta=algo.beta,
            desirable_weight=algo.desirable_weight,
            undesirable_weight=algo.undesirable_weight,
        )


def _judged(split: Split, index: int) -> Judged:
    sample = split.samples[index]
    assert isinstance(sample, Judged)
    return sample


# --- SFT -----------------------------------------------------------------------------------------


@dataclass
class Sft:
    """Next-token cross-entropy; the step's loss is the mean over its target tokens (all ranks')."""

    ctx: Context
    streams: tuple[str, ...] = ()

    def reference_sums(self, model, split, indices):
        return {}  # no reference model

    def step_batches(self, model, split, indices, micro_size):
        samples = [_demonstration(split, i) for i in indices]
        # Over every rank's targets: the step's loss is their token mean.
        targets = transport.average_token_count(float(sum(sum(s.targets) for s in samples)))
        divisor = max(1.0, targets)
        if self.ctx.algo.packing:
            packed = pack_sequences(samples, self.ctx.max_length, self.ctx.pad_id, self.ctx.device)
            micros = [
                Micro(indices, 1.0, (packed.rows(start, start + micro_size), divisor))
                for start in range(0, len(packed), micro_size)
            ]
        else:
            micros = [
                Micro(
                    part,
                    1.0,
                    (
                        pad_sequences(
                            [split.samples[i] for i in part], self.ctx.pad_id, self.ctx.device
                        ),
                        divisor,
                    ),
                )
                for part in _chunks(indices, micro_size)
            ]
        return StepBatches(micros)

    def loss(self, model, split, micro):
        batch, divisor = micro.batch
        logprobs, entropies = _label_scores(model, batch, entropy=True)
        labelled = batch.labels != IGNORE
        loss, metrics = sft_loss_from_logprobs(logprobs, labelled, num_tokens=divisor)
        # Weighted by the micro batch's share of the step's tokens, as the loss is.
        share = len(batch.target_rows) / divisor
        entropy = masked_mean(entropies, labelled) * share
        values = torch.stack([metrics["loss"], entropy]).tolist()  # one read of the device
        return loss, {"loss": values[0], "entropy": values[1]}, batch.tokens

    def evaluate(self, model, split, chunk_size):
        total, tokens = 0.0, 0
        with torch.no_grad():
            for part in _chunks(list(range(len(split))), chunk_size):
                batch = pad_sequences(
                    [split.samples[i] for i in part], self.ctx.pad_id, self.ctx.device
                )
                logprobs, _ = _label_scores(model, batch, entropy=False)
                loss, _ = sft_loss_from_logprobs(logprobs, batch.labels != IGNORE, num_tokens=1.0)
                total += float(loss)
                tokens += len(batch.target_rows)
        mean = total / max(1, tokens)
        return {"loss": mean, "perplexity": float(torch.tensor(mean, device="cpu").exp())}


def _label_scores(
    model: Any, batch: TokenBatch, *, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, L] log-probs of each position's label (0 where it has none, from the chunked head),
    and with `entropy` the entropies there."""
    states = final_states(
        model,
        keep=batch.input_ids.shape[1],
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )
    # IGNORE is no token: the full-logits route gathers at every position, so it reads 0 there.
    tokens = batch.labels.clamp(min=0)
    return token_scores(model, states, tokens, batch.target_rows, temperature=1.0, entropy=entropy)


def _demonstration(split: Split, index: int) -> Demonstration:
    sample = split.samples[index]
    assert isinstance(sample, Demonstration)
    return sample


# --- reward model --------------------------------------------------------------------------------


@dataclass
class RewardModel:
    """Bradley-Terry on pairs: a scalar head on the last token of prompt + completion."""

    ctx: Context
    streams: tuple[str, ...] = ()

    def reference_sums(self, model, split, indices):
        return {}  # no reference model

    def step_batches(self, model, split, indices, micro_size):
        return StepBatches(_split_evenly(indices, micro_size))

    def loss(self, model, split, micro):
        chosen, rejected, batch = self._rewards(model, split, micro.indices)
        loss, metrics = bradley_terry_loss(
            chosen, rejected, center_coef=self.ctx.algo.center_rewards_coef
        )
        return loss * micro.share, _weighted(metrics, micro.share), batch.tokens

    def evaluate(self, model, split, chunk_size):
        with torch.no_grad():
            parts = [
                self._rewards(model, split, part)
                for part in _chunks(list(range(len(split))), chunk_size)
            ]
        chosen = torch.cat([c for c, _, _ in parts])
        rejected = torch.cat([r for _, r, _ in parts])
        return bradley_terry_loss(chosen, rejected, center_coef=self.ctx.algo.center_rewards_coef)[
            1
        ]

    def _rewards(self, model, split, indices):
        samples = [_pair(split, i) for i in indices]
        prompts = [s.prompt for s in samples] * 2
        completions = [s.chosen for s in samples] + [s.rejected for s in samples]
        batch = pad_completions(prompts, completions, self.ctx.pad_id, self.ctx.device)
        scores = reward_scores(model, batch.input_ids, batch.attention_mask, batch.position_ids)
        chosen, rejected = scores.chunk(2)
        return chosen, rejected, batch


def build_reward_model(causal_lm: Any, pad_token_id: int) -> Any:
    """A sequence classifier with one output whose body is ``causal_lm``'s own (shared, not
    copied), and a fresh score head (drawn from the global torch generator)."""
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(causal_lm.config)
    config.num_labels = 1
    config.pad_token_id = pad_token_id
    config.architectures = None
    model = AutoModelForSequenceClassification.from_config(config, dtype=causal_lm.dtype)
    setattr(model, model.base_model_prefix, getattr(causal_lm, causal_lm.base_model_prefix))
    return model.to(causal_lm.device)


# --- the registry --------------------------------------------------------------------------------

ObjectiveFactory = Callable[[Context], Objective]

OBJECTIVES: dict[str, ObjectiveFactory] = {
    "dpo": lambda ctx: PairPreference(
        ctx,
        partial(dpo_loss, beta=ctx.algo.beta, label_smoothing=ctx.algo.label_smoothing),
        average=False,
    ),
    "ipo": lambda ctx: PairPreference(ctx, partial(ipo_loss, beta=ctx.algo.beta), average=True),
    "kto": Kto,
    "sft": Sft,
    "rm": RewardModel,
}
