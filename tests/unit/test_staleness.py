"""Stale batches corrected inside the learner's loss: truncated importance weights or drops,
by hand, and the same update as the former two-pass procedure (score the batch with the current
policy first, then train against those log-probs) when a step has one minibatch."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rollout.algorithms.losses import stale_correction
from rollout.engines.base import SamplingParams
from rollout.engines.hf.engine import HfEngine
from rollout.runtime.online.batches import RolloutBatch, pad_for_learner, unpad_left
from rollout.runtime.online.learner import Learner
from rollout.runtime.online.staleness import StaleCorrection
from tests.unit.conftest import learner_knobs

# Two rows, right-padded: ratios current / sampling exp(0.5) = 1.65, exp(1.5) = 4.48 (over the
# bound 2) in row 0; exp(-1) = 0.37 (under 1/2) and padding in row 1.
SAMPLING = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
CURRENT = torch.tensor([[-0.5, -0.5], [-1.5, 7.0]])
MASK = torch.tensor([[1, 1], [1, 0]])


def test_tis_weighs_each_token_by_its_truncated_ratio() -> None:
    weights, metrics = stale_correction(CURRENT, SAMPLING, MASK, "tis", 2.0)
    assert weights.flatten().tolist() == pytest.approx([math.exp(0.5), 2.0, math.exp(-1.0), 1.0])
    assert metrics["stale_truncated_fraction"].item() == pytest.approx(1 / 3)
    assert metrics["stale_weight_mean"].item() == pytest.approx(
        (math.exp(0.5) + 2.0 + math.exp(-1.0)) / 3
    )


def test_drop_zeroes_sequences_whose_ratio_leaves_the_bound() -> None:
    weights, metrics = stale_correction(CURRENT, SAMPLING, MASK, "drop", 2.0)
    # row 0 has a token at 4.48 > 2, row 1 one at 0.37 < 1/2: both dropped (padding weighs 1)
    assert weights.tolist() == [[0.0, 0.0], [0.0, 1.0]]
    assert metrics["stale_dropped_fraction"].item() == 1.0
    assert metrics["stale_weight_mean"].item() == 0.0
    kept, metrics = stale_correction(CURRENT, SAMPLING, MASK, "drop", 5.0)
    assert kept.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert metrics["stale_dropped_fraction"].item() == 0.0


def test_the_weights_carry_no_gradient() -> None:
    current = CURRENT.clone().requires_grad_(True)
    weights, _ = stale_correction(current, SAMPLING, MASK, "tis", 2.0)
    assert not weights.requires_grad


def test_a_mode_or_bound_the_learner_cannot_use_is_refused() -> None:
    with pytest.raises(ValueError, match="stale_samples mode 'clip'"):
        StaleCorrection("clip", 2.0)
    with pytest.raises(ValueError, match="tis_bound must be >= 1"):
        StaleCorrection("tis", 0.5)


@pytest.fixture(scope="module")
def stale_batch(tiny_llama) -> RolloutBatch:
    """8 sampled completions whose sampling log-probs are shifted by up to +-0, 1/3, 2/3 or 1
    per token (by row), as if an older policy had drawn them: some ratios leave [1/1.5, 1.5]."""
    engine = HfEngine(
        tiny_llama.model,
        eos_token_ids=tiny_llama.eos_token_ids,
        pad_token_id=tiny_llama.pad_token_id,
        tokenizer=tiny_llama.tokenizer,
        max_batch_size=None,
        device="cpu",
    )
    prompts = [tiny_llama.tokenizer.encode(t) for t in ("What is 2 + 3?", "Hi")]
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=10, n=4, seed=3))
    shift = torch.Generator().manual_seed(0)
    return RolloutBatch(
        prompt_ids=[prompts[c.prompt_index] for c in completions],
        completion_ids=[c.token_ids for c in completions],
        old_logprobs=[
            (
                torch.tensor(c.logprobs)
                + (i % 4) / 3 * (2 * torch.rand(len(c.logprobs), generator=shift) - 1)
            ).tolist()
            for i, c in enumerate(completions)
        ],
        rewards=torch.zeros(8),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.25, -0.25]),
        group_size=4,
        policy_version=0,
    )


@pytest.mark.parametrize("mode", ["tis", "drop"])
@pytest.mark.parametrize("micro_batch_size", [8, 2])
def test_one_minibatch_updates_as_scoring_first_did(
    tiny_llama, stale_batch, mode, micro_batch_size
):
    bound = 1.5
    settings = learner_knobs(minibatch_size=8, micro_batch_size=micro_batch_size)
    before = copy.deepcopy(tiny_llama.model)
    # The former procedure: a no-grad scoring pass, then a fresh-batch update against it.
    old_model = copy.deepcopy(tiny_llama.model)
    old_learner = _learner(old_model, settings, tiny_llama.pad_token_id)
    corrected, old_stale = _score_then_correct(old_learner, stale_batch, mode, bound)
    old_metrics = old_learner.update(corrected)
    # Now: one pass, the correction inside the loss.
    new_model = copy.deepcopy(tiny_llama.model)
    new_learner = _learner(new_model, settings, tiny_llama.pad_token_id)
    new_metrics = new_learner.update(stale_batch, StaleCorrection(mode, bound))

    moved = _flat(new_model) - _flat(before)
    assert moved.abs().max() > 0  # the step did something
    # SGD at lr 1: the parameters moved by minus the gradient
    torch.testing.assert_close(_flat(new_model), _flat(old_model), rtol=1e-4, atol=1e-6)
    assert new_metrics["loss"] == pytest.approx(old_metrics["loss"], rel=1e-4, abs=1e-7)
    assert new_metrics["ratio_mean"] == pytest.approx(1.0)
    if micro_batch_size == 8:  # else means over micro batches, not over the whole batch
        for name, value in old_stale.items():
            assert new_metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    if mode == "drop":
        assert 0 < new_metrics["stale_dropped_fraction"] < 1  # drops some, keeps some
    else:
        assert new_metrics["stale_truncated_fraction"] > 0


def _learner(model, settings, pad_id: int) -> Learner:
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return Learner(model, optimizer, scheduler, settings, pad_token_id=pad_id, device="cpu")


def _score_then_correct(
    learner: Learner, batch: RolloutBatch, mode: str, bound: float
) -> tuple[RolloutBatch, dict[str, float]]:
    """The removed two-pass correction, written out: score with the current policy, take those
    log-probs as the old ones and weigh each token's advantage (whole-batch metrics)."""
    with torch.no_grad():
        padded = pad_for_learner(batch, learner.pad_token_id, "cpu")
        scores = learner.completion_logprobs(learner.model, batch, padded)
        current = unpad_left(scores, [len(c) for c in batch.completion_ids])
    weighted, weights_all, dropped, truncated = [], [], 0, 0
    for now, then, advantage in zip(
        current, batch.old_logprobs, batch.advantages.tolist(), strict=True
    ):
        ratios = [math.exp(a - b) for a, b in zip(now, then, strict=True)]
        if mode == "tis":
            weights = [min(r, bound) for r in ratios]
            truncated += sum(r > bound for r in ratios)
        else:
            keep = all(1 / bound <= r <= bound for r in ratios)
            weights = [float(keep)] * len(ratios)
            dropped += not keep
        weighted.append([advantage * w for w in weights])
        weights_all += weights
    corrected = copy.copy(batch)
    corrected.old_logprobs = current
    corrected.token_advantages = weighted
    metrics = {"stale_weight_mean": sum(weights_all) / len(weights_all)}
    if mode == "tis":
        metrics["stale_truncated_fraction"] = truncated / len(weights_all)
    else:
        metrics["stale_dropped_fraction"] = dropped / len(batch)
    return corrected, metrics


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])
