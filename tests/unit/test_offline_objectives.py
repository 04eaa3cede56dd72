"""The offline objectives on the tiny model: micro batches give the gradient of one pass over the
step, a cached reference equals a live one, and the reward model learns from pairs."""

from __future__ import annotations

import copy

import pytest
import torch

from rollout.config.algorithm import DpoConfig, IpoConfig, KtoConfig, RmConfig, SftConfig
from rollout.models.samples import HfTextTokenizer, SampleRules
from rollout.runtime.offline.data import encode_split
from rollout.runtime.offline.objectives import (
    OBJECTIVES,
    Context,
    build_reward_model,
)
from rollout.runtime.offline.reference import CachedReference, LiveReference

FIELDS = {
    "prompt": "prompt",
    "chosen": "chosen",
    "rejected": "rejected",
    "completion": "completion",
    "label": "label",
}
RECORDS = [
    {
        "prompt": f"What is {a} + {b}?",
        "chosen": str(a + b),
        "rejected": f"{a}{b}",
        "completion": str(a + b) if a % 2 else f"{a}{b}",
        "label": bool(a % 2),
    }
    for a, b in [(12, 7), (30, 41), (5, 9), (77, 16), (23, 23), (8, 64)]
]
ALGOS = {
    "dpo": DpoConfig(kind="dpo", beta=0.5, label_smoothing=0.1),
    "ipo": IpoConfig(kind="ipo", beta=0.5),
    "kto": KtoConfig(kind="kto", beta=0.5, desirable_weight=2.0),
    "sft": SftConfig(kind="sft"),
    "sft-packed": SftConfig(kind="sft", packing=True, max_length=64),
    "rm": RmConfig(kind="rm", center_rewards_coef=0.01),
}


def setup(tiny_llama, name: str):
    algo = ALGOS[name]
    torch.manual_seed(0)
    model = copy.deepcopy(tiny_llama.model).float()
    if algo.kind == "rm":
        model = build_reward_model(model, tiny_llama.pad_token_id)
    rules = SampleRules(tokenizer=HfTextTokenizer.of(tiny_llama), fields=FIELDS)
    split = encode_split("train", "x", RECORDS, rules, kind=algo.kind, max_length=64)
    ctx = Context(pad_id=tiny_llama.pad_token_id, device="cpu", algo=algo, max_length=64)
    objective = OBJECTIVES[algo.kind](ctx)
    # A reference that differs from the policy, so log-ratios are not all 0.
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.05 * torch.randn_like(param))
    ctx.reference = LiveReference(reference.eval())
    return model, objective, split, ctx


def gradient(model, objective, split, indices, micro_size):
    model.zero_grad(set_to_none=True)
    step = objective.step_batches(model, split, indices, micro_size)
    total = {}
    for micro in step.micros:
        loss, metrics, _ = objective.loss(model, split, micro)
        loss.backward()
        for key, value in metrics.items():
            total[key] = total.get(key, 0.0) + value
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, total


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_micro_batches_give_the_gradient_of_one_pass(tiny_llama, name):
    model, objective, split, _ = setup(tiny_llama, name)
    indices = [4, 0, 3, 5]
    whole, whole_metrics = gradient(model, objective, split, indices, micro_size=4)
    parts, parts_metrics = gradient(model, objective, split, indices, micro_size=1)
    assert whole
    for key, grad in whole.items():
        torch.testing.assert_close(parts[key], grad, rtol=1e-4, atol=1e-6, msg=key)
    assert parts_metrics["loss"] == pytest.approx(whole_metrics["loss"], rel=1e-5)


@pytest.mark.parametrize("name", ["dpo", "kto"])
def test_a_cached_reference_gives_what_the_live_one_does(tiny_llama, name):
    model, objective, split, ctx = setup(tiny_llama, name)
    live = ctx.reference
    everything = list(range(len(split)))
    with torch.no_grad():
        sums = objective.reference_sums(live.model, split, everything)
    tables = {f"train.{stream}": values for stream, values in sums.items()}
    assert sorted(sums) == sorted(objective.streams)
    live_metrics = objective.evaluate(model, split, chunk_size=4)
    ctx.reference = CachedReference(tables)
    cached_metrics = objective.evaluate(model, split, chunk_size=4)
    assert cached_metrics == pytest.approx(live_metrics, abs=1e-5)
    assert abs(live_metrics["margin"]) > 1e-3


@pytest.mark.parametrize("name", ["dpo", "kto"])
def test_evaluation_before_training_is_exactly_chance(tiny_llama, name):
    """Reference log-probs computed in the chunks evaluation uses: margins are exactly 0."""
    model, objective, split, ctx = setup(tiny_llama, name)
    everything = list(range(len(split)))
    tables = {}
    with torch.no_grad():
        for part in (everything[:4], everything[4:]):
            for stream, values in objective.reference_sums(model, split, part).items():
                tables.setdefault(f"train.{stream}", []).append(values)
    ctx.reference = CachedReference({k: torch.cat(v) for k, v in tables.items()})
    metrics = objective.evaluate(model, split, chunk_size=4)
    assert metrics["margin"] == 0.0 and metrics["accuracy"] == 0.5


def test_sft_evaluation_is_the_token_mean_cross_entropy(tiny_llama):
    model, objective, split, _ = setup(tiny_llama, "sft")
    metrics = objective.evaluate(model, split, chunk_size=4)
    _, step = gradient(model, objective, split, list(range(len(split))), micro_size=6)
    assert metrics["loss"] == pytest.approx(step["loss"], rel=1e-5)
    assert metrics["perplexity"] == pytest.approx(torch.tensor(metrics["loss"]).exp().item())
