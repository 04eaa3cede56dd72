"""Log-likelihood scoring on the tiny model: the batched sums equal a token-by-token reference,
and the model's own greedy continuation wins where it must."""

from __future__ import annotations

import pytest
import torch

from rollout.harness.eval.choice import choose_by_loglik
from rollout.harness.eval.loglik import continuation_logprobs


def _one_by_one(model, prompt: list[int], continuation: list[int]) -> float:
    """The reference: one unpadded forward per continuation, each token's log-prob added."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + continuation])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return sum(float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(continuation))


def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_batched_sums_match_one_by_one(tiny_llama):
    model, tokenizer = tiny_llama.model, tiny_llama.tokenizer
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=True)
    continuations = [
        tokenizer.encode(text, add_special_tokens=False)
        for text in (" Paris", " a city of lights and rain", " 42")
    ]
    got = continuation_logprobs(model, prompt, continuations, tiny_llama.pad_token_id)
    expected = [_one_by_one(model, prompt, tokens) for tokens in continuations]
    assert got == pytest.approx(expected, abs=1e-4)
    assert all(value < 0 for value in got)
    assert continuation_logprobs(model, prompt, [[]], tiny_llama.pad_token_id) == [0.0]


def test_the_models_own_greedy_continuation_wins(tiny_llama):
    """Against the same tokens with only the last one changed, the greedy continuation must score
    higher: the prefixes are equal, and its last token is the argmax after that prefix."""
    model, tokenizer = tiny_llama.model, tiny_llama.tokenizer
    prompt = tokenizer.encode("Once upon a time", add_special_tokens=True)
    greedy = _greedy(model, prompt, 5)
    changed = [*greedy[:-1], (greedy[-1] + 1) % model.config.vocab_size]
    other = [*greedy[:-1], (greedy[-1] + 7) % model.config.vocab_size]
    choices = {"changed": changed, "greedy": greedy, "other": other}

    def logprob(_prompt: str, name: str) -> float:
        return continuation_logprobs(model, prompt, [choices[name]], tiny_llama.pad_token_id)[0]

    best, scores = choose_by_loglik("Once upon a time", list(choices), logprob)
    assert list(choices)[best] == "greedy", scores
