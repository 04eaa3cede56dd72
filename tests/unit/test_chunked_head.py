"""The chunked vocabulary head against the full logits: the same log-probs, entropies and
gradients (of the hidden states, the weight and the bias) for every chunk size, temperature and
selection of positions, and no [tokens, V] tensor in its backward."""

from __future__ import annotations

import pytest
import torch

from rollout.algorithms.chunked_head import chunk_tokens, head_logprobs
from rollout.algorithms.losses import entropy_from_logits, token_logprobs

M, H, V = 23, 8, 97


def _inputs(bias: bool, dtype=torch.float32):
    generator = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(M, H, generator=generator, dtype=dtype).requires_grad_()
    weight = torch.randn(V, H, generator=generator, dtype=dtype).requires_grad_()
    b = torch.randn(V, generator=generator, dtype=dtype).requires_grad_() if bias else None
    tokens = torch.randint(0, V, (M,), generator=generator)
    return hidden, weight, b, tokens


def _grads(*tensors):
    grads = [t.grad.clone() for t in tensors if t is not None]
    for t in tensors:
        if t is not None:
            t.grad = None
    return grads


# Rows: every position, a ragged subset (padding in between), none.
ROWS = [list(range(M)), [0, 1, 2, 7, 8, 15, 22], []]


@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", ROWS, ids=["all", "ragged", "none"])
def test_values_and_gradients_equal_the_full_logits(chunk, temperature, bias, rows):
    hidden, weight, b, tokens = _inputs(bias)
    selected = torch.zeros(M, dtype=torch.bool)
    selected[rows] = True
    upstream = torch.randn(M, generator=torch.Generator(device="cpu").manual_seed(1))

    logprobs, entropy = head_logprobs(
        hidden,
        weight,
        b,
        tokens,
        torch.tensor(rows, dtype=torch.long),
        temperature=temperature,
        chunk_size=chunk,
        entropy=True,
    )
    (logprobs * upstream).sum().backward()
    chunked = _grads(hidden, weight, b)

    logits = (hidden @ weight.t() + (b if b is not None else 0))[None]
    full = token_logprobs(logits, tokens[None], temperature)[0] * selected
    full_entropy = entropy_from_logits(logits.detach(), temperature)[0] * selected
    (full * upstream).sum().backward()
    expected = _grads(hidden, weight, b)

    torch.testing.assert_close(logprobs, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, full_entropy, rtol=1e-5, atol=1e-5)
    assert not entropy.requires_grad
    for got, want in zip(chunked, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if rows:
        assert chunked[0].abs().sum() > 0


def test_unselected_positions_get_no_gradient():
    hidden, weight, _, tokens = _inputs(False)
    logprobs, _ = head_logprobs(hidden, weight, None, tokens, torch.tensor([3, 5]), chunk_size=1)
    logprobs.sum().backward()
    moved = hidden.grad.abs().sum(-1) > 0
    assert moved.nonzero().flatten().tolist() == [3, 5]


def test_bfloat16_compute_matches_the_bfloat16_head():
    """compute_dtype bfloat16 over float32 weights is what an autocast lm_head gives: the
    projection in bfloat16, the softmax in float32."""
    hidden, weight, _, tokens = _inputs(False)
    rows = torch.arange(M)
    logprobs, _ = head_logprobs(
        hidden, weight, None, tokens, rows, compute_dtype=torch.bfloat16, chunk_size=5
    )
    logits = (hidden.bfloat16() @ weight.bfloat16().t())[None]
    torch.testing.assert_close(logprobs, token_logprobs(logits, tokens[None])[0])
    logprobs.sum().backward()
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32


def test_the_backward_holds_no_full_logits():
    """Sizes of every tensor the backward allocates stay below one chunk's logits (plus the
    weight's gradient): the [M, V] logits never exist."""
    hidden, weight, _, tokens = _inputs(False)
    logprobs, _ = head_logprobs(hidden, weight, None, tokens, torch.arange(M), chunk_size=4)
    largest = []

    class Sizes(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                largest.append(out.numel())
            return out

    with Sizes():
        logprobs.sum().backward()
    assert max(n for n in largest if n != V * H) <= 4 * V
    assert M * V > 4 * V


def test_chunk_tokens_follows_the_vocabulary():
    assert chunk_tokens(49_152) == 1365  # 256 MiB of float32 logits
    assert chunk_tokens(10**9) == 1


def test_bad_arguments_are_refused():
    hidden, weight, _, tokens = _inputs(False)
    with pytest.raises(ValueError, match="temperature"):
        head_logprobs(hidden, weight, None, tokens, torch.arange(M), temperature=0.0)
    with pytest.raises(ValueError, match="hidden must be"):
        head_logprobs(hidden[None], weight, None, tokens, torch.arange(M))
