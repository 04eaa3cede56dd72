"""The learner on the tiny model: its recomputed log-probs match the engine's, gradient
accumulation changes nothing, and an update moves probability toward positive advantages."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from rollout.engines.base import SamplingParams
from rollout.engines.hf.engine import HfEngine
from rollout.runtime.online.batches import RolloutBatch
from rollout.runtime.online.learner import Learner, LearnerKnobs
from tests.unit.conftest import learner_knobs


def knobs(**changes) -> LearnerKnobs:
    return learner_knobs(**changes)


def learner_for(model, settings: LearnerKnobs, pad_id: int, lr: float = 0.0) -> Learner:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return Learner(model, optimizer, scheduler, settings, pad_token_id=pad_id, device="cpu")


@pytest.fixture(scope="module")
def rollout_batch(tiny_llama) -> RolloutBatch:
    """8 sampled completions of 2 prompts of different lengths, with made-up advantages."""
    engine = HfEngine(
        tiny_llama.model,
        eos_token_ids=tiny_llama.eos_token_ids,
        pad_token_id=tiny_llama.pad_token_id,
        tokenizer=tiny_llama.tokenizer,
        max_batch_size=None,
        device="cpu",
    )
    prompts = [tiny_llama.tokenizer.encode(t) for t in ("What is 2 + 3?", "Hi")]
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=12, n=4, seed=7))
    return RolloutBatch(
        prompt_ids=[prompts[c.prompt_index] for c in completions],
        completion_ids=[c.token_ids for c in completions],
        old_logprobs=[c.logprobs for c in completions],
        rewards=torch.zeros(8),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.0, 0.0]),
        group_size=4,
        policy_version=0,
    )


def test_first_update_sees_ratio_one(tiny_llama, rollout_batch):
    model = copy.deepcopy(tiny_llama.model)
    metrics = learner_for(model, knobs(), tiny_llama.pad_token_id).update(rollout_batch)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert abs(metrics["approx_kl"]) < 1e-5
    assert metrics["clip_fraction"] == 0.0


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "batch_token_mean", "constant"])
def test_micro_batches_accumulate_to_the_full_batch_gradient(tiny_llama, rollout_batch, mode):
    updated = []
    for micro in (8, 2):
        model = copy.deepcopy(tiny_llama.model)
        settings = knobs(micro_batch_size=micro, loss_aggregation=mode)
        learner_for(model, settings, tiny_llama.pad_token_id, lr=1.0).update(rollout_batch)
        updated.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    original = torch.cat([p.detach().flatten() for p in tiny_llama.model.parameters()])
    assert not torch.equal(updated[0], original)  # the step did something
    torch.testing.assert_close(updated[0], updated[1], rtol=1e-4, atol=1e-6)


def test_update_moves_probability_toward_positive_advantages(tiny_llama, rollout_batch):
    model = copy.deepcopy(tiny_llama.model)
    learner = learner_for(model, knobs(update_epochs=3), tiny_llama.pad_token_id, lr=0.5)
    before = _sequence_logprobs(model, rollout_batch, tiny_llama.pad_token_id)
    learner.update(rollout_batch)
    after = _sequence_logprobs(model, rollout_batch, tiny_llama.pad_token_id)
    change = after - before
    assert change[0] > 0 and change[4] > 0  # advantage +1
    assert change[1] < 0 and change[5] < 0  # advantage -1


def _sequence_logprobs(model, batch: RolloutBatch, pad_id: int) -> torch.Tensor:
    from rollout.algorithms.losses import token_logprobs
    from rollout.runtime.online.batches import pad_for_learner

    padded = pad_for_learner(batch, pad_id, "cpu")
    with torch.no_grad():
        logits = model(
            input_ids=padded.input_ids,
            attention_mask=padded.attention_mask,
            position_ids=padded.position_ids,
            logits_to_keep=padded.logits_to_keep,
        ).logits[:, :-1]
        logprobs = token_logprobs(logits, padded.targets, 1.0)
    return (logprobs * padded.completion_mask).sum(-1)


def test_shared_prefix_forward_equals_the_plain_forward(tiny_llama, rollout_batch):
    """Each prompt run once for its 4 completions gives the plain forward's log-probs and
    gradients (the batch has two prompts of different lengths and ragged completions)."""
    from rollout.runtime.online.shared_prefix import shared_prefix_logprobs, shares_prompts

    assert shares_prompts(rollout_batch)
    pad_id = tiny_llama.pad_token_id
    model = copy.deepcopy(tiny_llama.model).train()
    weights = rollout_batch.advantages[:, None]
    results = []
    for shared in (False, True):
        model.zero_grad(set_to_none=True)
        if shared:
            logprobs, _ = shared_prefix_logprobs(
                model, rollout_batch, pad_token_id=pad_id, device="cpu", temperature=0.7
            )
        else:
            logprobs = _plain_logprobs(model, rollout_batch, pad_id, temperature=0.7)
        (logprobs * weights).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((logprobs.detach(), grads))
    (plain, plain_grads), (shared, shared_grads) = results
    assert plain.abs().sum() > 0 and plain_grads.abs().sum() > 0
    torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-5)
    # Summed in another order, single elements differ by float rounding; the whole does not.
    assert (shared_grads - plain_grads).norm() / plain_grads.norm() < 1e-4


def _plain_logprobs(model, batch: RolloutBatch, pad_id: int, temperature: float) -> torch.Tensor:
    from rollout.algorithms.losses import token_logprobs
    from rollout.runtime.online.batches import pad_for_learner

    padded = pad_for_learner(batch, pad_id, "cpu")
    logits = model(
        input_ids=padded.input_ids,
        attention_mask=padded.attention_mask,
        position_ids=padded.position_ids,
        logits_to_keep=padded.logits_to_keep,
    ).logits[:, :-1]
    return token_logprobs(logits, padded.targets, temperature) * padded.completion_mask


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "batch_token_mean", "constant"])
@pytest.mark.parametrize("micro", [8, 2])
def test_skipping_zero_advantage_rows_changes_no_update(
    tiny_llama, rollout_batch, mode, micro, monkeypatch
):
    """Rows 6 and 7 have advantage 0 (with micro batches of 2, a whole micro batch): skipping
    their forward and backward gives the same weights as computing them."""
    updated = []
    for skip in (True, False):
        model = copy.deepcopy(tiny_llama.model)
        settings = knobs(micro_batch_size=micro, loss_aggregation=mode)
        learner = learner_for(model, settings, tiny_llama.pad_token_id, lr=1.0)
        if not skip:  # the reference: every row computed
            monkeypatch.setattr(learner, "_rows_with_gradient", lambda m, a: list(range(len(m))))
        metrics = learner.update(rollout_batch)
        assert metrics["skipped_fraction"] == (0.25 if skip else 0.0)
        updated.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(updated[0], updated[1], rtol=1e-5, atol=1e-7)


def test_a_batch_without_signal_still_steps_adamw_as_for_zero_gradients(tiny_llama, rollout_batch):
    """Every advantage 0: nothing is computed, yet AdamW applies weight decay and its moments
    exactly as it would for the zero gradients a full computation gives."""
    batch = rollout_batch.select(list(range(8)))
    batch.advantages = torch.zeros(8)
    updated = []
    for skip in (True, False):
        model = copy.deepcopy(tiny_llama.model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        learner = Learner(
            model,
            optimizer,
            scheduler,
            knobs(),
            pad_token_id=tiny_llama.pad_token_id,
            device="cpu",
        )
        if not skip:
            learner._rows_with_gradient = lambda m, a: list(range(len(m)))
        learner.update(batch)
        updated.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    original = torch.cat([p.detach().flatten() for p in tiny_llama.model.parameters()])
    assert not torch.equal(updated[0], original)  # weight decay moved them
    torch.testing.assert_close(updated[0], updated[1])


def test_the_learner_reports_the_policy_entropy(tiny_llama, rollout_batch):
    """Entropy at each completion token, the same from the shared-prefix forward as from the
    plain one, position by position; train/entropy is its mean over the rows trained on."""
    from rollout.algorithms.losses import entropy_from_logits, masked_mean
    from rollout.runtime.online.batches import pad_for_learner
    from rollout.runtime.online.shared_prefix import shared_prefix_logprobs

    model = copy.deepcopy(tiny_llama.model)
    padded = pad_for_learner(rollout_batch, tiny_llama.pad_token_id, "cpu")
    with torch.no_grad():
        logits = model(
            input_ids=padded.input_ids,
            attention_mask=padded.attention_mask,
            position_ids=padded.position_ids,
            logits_to_keep=padded.logits_to_keep,
        ).logits[:, :-1]
        _, shared = shared_prefix_logprobs(
            model,
            rollout_batch,
            pad_token_id=tiny_llama.pad_token_id,
            device="cpu",
            temperature=1.0,
            entropy=True,
        )
    plain = entropy_from_logits(logits) * padded.completion_mask
    assert plain.sum() > 0
    torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-5)

    metrics = learner_for(model, knobs(), tiny_llama.pad_token_id).update(rollout_batch)
    trained = padded.completion_mask.clone()
    trained[6:] = False  # rows 6 and 7 have advantage 0: skipped
    assert metrics["entropy"] == pytest.approx(masked_mean(plain, trained).item(), rel=1e-5)


class _DeviceReads(TorchFunctionMode):
    """Counts the calls from rollout's code that copy a tensor's value to the host: on a GPU
    each waits for every kernel queued before it. (transformers reads each forward's attention
    mask once, to choose its attention kernel: not counted, not ours.)"""

    READS: frozenset = frozenset(
        {
            torch.Tensor.item,
            torch.Tensor.tolist,
            torch.Tensor.__float__,
            torch.Tensor.__int__,
            torch.Tensor.__bool__,
            torch.Tensor.cpu,
            torch.Tensor.numpy,
        }
    )

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            caller = inspect.currentframe().f_back  # type: ignore[union-attr]
            where = caller.f_code.co_filename if caller else ""
            if "/rollout/" in where:
                self.reads.append(f"{Path(where).name}:{caller.f_lineno} {func.__name__}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kl", [0.0, 0.1], ids=["no_reference", "kl"])
def test_an_update_reads_the_device_as_often_with_more_micro_batches(tiny_llama, rollout_batch, kl):
    """Metrics, the loss and the gradient norm stay on the device through the micro batches and
    are read once at the end: the reads do not grow with the micro batches."""
    reads = []
    for micro in (8, 4, 2, 1):
        model = copy.deepcopy(tiny_llama.model)
        settings = knobs(micro_batch_size=micro, kl_coef=kl, max_grad_norm=1.0)
        learner = learner_for(model, settings, tiny_llama.pad_token_id, lr=0.1)
        if kl:
            learner.reference = copy.deepcopy(tiny_llama.model).requires_grad_(False)
        recorder = _DeviceReads()
        with recorder:
            metrics = learner.update(rollout_batch)
        assert metrics["grad_norm"] > 0
        reads.append(recorder.reads)
    assert all(r == reads[0] for r in reads), reads
    # The minibatch's advantages (host memory) and the metrics, each read once.
    assert len(reads[0]) == 2, reads[0]


def test_minibatches_split_any_batch_into_the_planned_number_of_optimizer_steps():
    from rollout.runtime.online.learner import _minibatch_rows

    planned = knobs(minibatch_size=4)
    assert _minibatch_rows(8, planned) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    fixed = knobs(minibatch_size=4, minibatches=2)
    assert _minibatch_rows(8, fixed) == _minibatch_rows(8, planned)  # the planned size: the same
    assert _minibatch_rows(11, fixed) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]
    runs = _minibatch_rows(3, knobs(minibatch_size=1, minibatches=4))
    assert [row for run in runs for row in run] == [0, 1, 2]


def test_a_batch_of_another_size_still_takes_the_planned_optimizer_steps(tiny_llama, rollout_batch):
    model = copy.deepcopy(tiny_llama.model)
    settings = knobs(minibatch_size=4, micro_batch_size=4, minibatches=2)
    learner = learner_for(model, settings, tiny_llama.pad_token_id, lr=0.1)
    learner.update(rollout_batch.select([0, 1, 2, 3, 4, 5]))  # 6 rows, not 8
    assert learner.optimizer_steps == 2
