"""The learner's scoring through the chunked head against the full-logits route, on real
(tiny) transformers models: the same log-probs, entropies and gradients in the plain forward,
the shared-prefix forward, with gradient checkpointing, with tied and untied embeddings; and the
models it must not take (logits post-processed after the head) take the full logits."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollout.runtime import logprobs as scoring
from rollout.runtime.online.batches import RolloutBatch, pad_for_learner
from rollout.runtime.online.learner import Learner
from rollout.runtime.online.shared_prefix import shared_prefix_logprobs
from tests.unit.conftest import learner_knobs

PAD = 0
KNOBS = learner_knobs(minibatch_size=6, micro_batch_size=3, temperature=0.8, max_new_tokens=6)


def _model(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=211,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(config).float()


def _batch() -> RolloutBatch:
    """Two prompts of different lengths, 3 ragged completions each (one of 1 token)."""
    generator = torch.Generator(device="cpu").manual_seed(3)

    def ids(n: int) -> list[int]:
        return torch.randint(1, 211, (n,), generator=generator).tolist()

    prompts = [ids(5), ids(2)]
    completions = [ids(n) for n in (4, 1, 6, 3, 5, 2)]
    return RolloutBatch(
        prompt_ids=[prompts[i // 3] for i in range(6)],
        completion_ids=completions,
        old_logprobs=[[-1.0] * len(c) for c in completions],
        rewards=torch.zeros(6),
        advantages=torch.tensor([1.0, -0.5, 0.25, -1.0, 0.5, 2.0]),
        group_size=3,
        policy_version=0,
    )


@pytest.fixture
def full_logits(monkeypatch):
    """Force the full-logits route (the reference the chunked head must match)."""

    def force() -> None:
        monkeypatch.setattr(scoring, "chunked_head", lambda model: None)

    return force


def _plain(model, batch, temperature):
    padded = pad_for_learner(batch, PAD, "cpu")
    states = scoring.final_states(
        model,
        keep=padded.logits_to_keep,
        input_ids=padded.input_ids,
        attention_mask=padded.attention_mask,
        position_ids=padded.position_ids,
        use_cache=False,
    )[:, :-1]
    logprobs, entropy = scoring.token_scores(
        model,
        states,
        padded.targets,
        padded.completion_rows,
        temperature=temperature,
        entropy=True,
    )
    mask = padded.completion_mask
    return logprobs * mask, entropy * mask


def _shared(model, batch, temperature):
    return shared_prefix_logprobs(
        model, batch, pad_token_id=PAD, device="cpu", temperature=temperature, entropy=True
    )


def _run(model, forward, batch, temperature):
    model.zero_grad(set_to_none=True)
    logprobs, entropy = forward(model, batch, temperature)
    (logprobs * batch.advantages[:, None]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy, grads


@pytest.mark.parametrize("forward", [_plain, _shared], ids=["plain", "shared_prefix"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_chunked_head_equals_the_full_logits(full_logits, forward, temperature, tied):
    model = _model(tied).train()
    assert scoring.chunked_head(model) is model.lm_head
    chunked = _run(model, forward, _batch(), temperature)
    full_logits()
    full = _run(model, forward, _batch(), temperature)

    torch.testing.assert_close(chunked[0], full[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked[1], full[1], rtol=1e-5, atol=1e-5)
    assert chunked[2].keys() == full[2].keys()
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert head in chunked[2]
    for name, grad in full[2].items():
        torch.testing.assert_close(chunked[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _learner_gradients(model: LlamaForCausalLM, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """The gradients of one learner update (an SGD step of lr 1 shows them as weight changes)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    Learner(model, optimizer, scheduler, KNOBS, pad_token_id=PAD, device="cpu").update(batch)
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


def test_gradient_checkpointing_gives_the_same_update():
    """Without checkpointing the learner takes the shared-prefix forward (the batch's
    completions share prompts); with it, the plain forward recomputing every layer in the
    backward; both through the chunked head. The updates agree."""
    plain = _model(tied=True)
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing_enable()
    reference = _learner_gradients(plain, _batch())
    got = _learner_gradients(checkpointed, _batch())
    assert any(g.abs().sum() > 0 for g in reference.values())
    for name, change in reference.items():
        torch.testing.assert_close(got[name], change, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "setting",
    [{"final_logit_softcapping": 30.0}, {"logit_scale": 0.5}, {"logits_scaling": 4.0}],
    ids=lambda s: next(iter(s)),
)
def test_logits_changed_after_the_head_take_the_full_route(setting):
    model = _model(tied=False)
    for name, value in setting.items():
        setattr(model.config, name, value)
    assert scoring.chunked_head(model) is None


def test_an_unknown_architecture_or_a_wrapped_head_takes_the_full_route():
    model = _model(tied=False)
    model.config.model_type = "some-new-arch"
    assert scoring.chunked_head(model) is None
    model = _model(tied=False)
    model.lm_head = torch.nn.Sequential(model.lm_head)
    assert scoring.chunked_head(model) is None


def test_the_full_route_is_the_models_own_forward(full_logits):
    """final_states hands the full route the model's logits (the last `keep` positions)."""
    model = _model(tied=True).eval()
    full_logits()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        states = scoring.final_states(model, keep=2, input_ids=ids, use_cache=False)
        expected = model(input_ids=ids).logits[:, -2:]
    torch.testing.assert_close(states, expected)


def test_the_planner_knows_the_chunked_head():
    """The memory estimate's copies of the runtime's constants (the planner never imports
    torch)."""
    from rollout.algorithms.chunked_head import DEFAULT_CHUNK_BYTES
    from rollout.planner import memory

    assert memory.CHUNKED_HEAD_MODEL_TYPES == scoring.CHUNKED_HEAD_MODEL_TYPES
    assert memory.CHUNK_BYTES == DEFAULT_CHUNK_BYTES
