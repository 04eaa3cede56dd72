"""Sampling one token per row from next-token logits: the engine's sampling, in one pass over
the batch, with the log-probs the learner recomputes.

What a sampled log-prob is, precisely: log_softmax(logits / T)[token] in float32, T the
temperature (T = 1 when greedy), computed BEFORE top-k/top-p truncation. The alternatives a
request may ask for (its top_logprobs most likely tokens) are log-probs of that same distribution.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rollout.engines.base import SamplingParams


class TopLogprobs(NamedTuple):
    """The most likely tokens of each row, most likely first."""

    token_ids: torch.Tensor
    """[B, N]"""
    logprobs: torch.Tensor
    """[B, N], under the same log_softmax(logits / T) as the sampled token's log-prob."""


class Sampled(NamedTuple):
    token_ids: torch.Tensor
    """[B]"""
    logprobs: torch.Tensor
    """[B]"""
    top: TopLogprobs | None
    """The alternatives when some row asked for them, else None (and nothing was computed)."""


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> Sampled:
    """One token per row from logits [B, V]: token ids [B], their log-probs [B], and the
    params.top_logprobs most likely tokens of every row when asked for.

    The log-prob is under log_softmax(logits / T) before top-k/top-p truncation; temperature 0
    is greedy and reports T=1 log-probs.
    """
    temperature = params.temperature if params.temperature > 0 else 1.0
    scaled = logits if temperature == 1.0 else logits / temperature
    # log_softmax(scaled)[token] is scaled[token] - logsumexp(scaled): one reduction over the
    # vocabulary rather than a [B, V] log-prob tensor, and the exponentials are reused to sample.
    peak = scaled.amax(-1, keepdim=True)
    weights = (scaled - peak).exp_()  # probabilities up to a factor per row
    log_normalizer = weights.sum(-1, keepdim=True).log_() + peak
    if params.temperature > 0:
        if 0 < params.top_k < logits.shape[-1] or params.top_p < 1.0:
            truncated = truncate(scaled, top_k=params.top_k, top_p=params.top_p)
            weights = (truncated - peak).exp_()  # -inf, the truncated tokens, becomes weight 0
        token_ids = sample_proportional(weights, generator)
    else:
        token_ids = scaled.argmax(-1)
    logprobs = (scaled.gather(-1, token_ids[:, None]) - log_normalizer).squeeze(-1)
    return Sampled(token_ids, logprobs, top_logprobs(scaled, log_normalizer, params.top_logprobs))


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
    *,
    top: int = 0,
) -> Sampled:
    """sample_tokens with parameters per row: logits [B, V], temperature [B] (0: greedy),
    top_k [B] (0: off), top_p [B] (1: off), uniform [B] (each row's draw in [0, 1), unused by
    greedy rows) -> token ids [B] and log-probs [B] as sample_tokens reports them, and the `top`
    most likely tokens of every row when `top` > 0 (the most any row asked for: each row keeps
    its own first few).
    """
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits.dtype)
    scaled = logits / scale[:, None]
    peak = scaled.amax(-1, keepdim=True)
    weights = (scaled - peak).exp_()
    log_normalizer = weights.sum(-1, keepdim=True).log_() + peak
    truncating = ~greedy & (((top_k > 0) & (top_k < logits.shape[-1])) | (top_p < 1.0))
    if bool(truncating.any()):
        truncated = truncate_rows(
            scaled, top_k.masked_fill(~truncating, 0), top_p.masked_fill(~truncating, 1.0)
        )
        weights = (truncated - peak).exp_()
    sampled = sample_proportional(weights, None, uniform=uniform.to(weights.dtype)[:, None])
    token_ids = torch.where(greedy, scaled.argmax(-1), sampled)
    logprobs = (scaled.gather(-1, token_ids[:, None]) - log_normalizer).squeeze(-1)
    return Sampled(token_ids, logprobs, top_logprobs(scaled, log_normalizer, top))


def top_logprobs(
    scaled: torch.Tensor, log_normalizer: torch.Tensor, count: int
) -> TopLogprobs | None:
    """The `count` most likely tokens of scaled logits [B, V] (logits / T) with their log-probs,
    scaled - log_normalizer [B, 1]: the sampled token's log-prob, exactly, when it is among them.
    None when count is 0, so that the default path costs nothing."""
    if count <= 0:
        return None
    values, token_ids = scaled.topk(min(count, scaled.shape[-1]), dim=-1)
    return TopLogprobs(token_ids, values - log_normalizer)


def sample_proportional(
    weights: torch.Tensor,
    generator: torch.Generator | None,
    *,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """One index per row of weights [B, V] (>= 0, not all 0), drawn with probability
    proportional to its weight; a weight of 0 is never drawn. `uniform` [B, 1] gives each row's
    draw in [0, 1); without it they come from `generator`.

    Inverse CDF: one uniform draw per row located in the running sum of the weights. It draws what
    torch.multinomial draws, but multinomial spends one random number per vocabulary entry,
    which costs more than the rest of sampling together on a 50k vocabulary.
    """
    cdf = weights.cumsum(-1)
    total = cdf[:, -1:].contiguous()  # searchsorted copies a non-contiguous argument anyway
    if uniform is None:
        uniform = torch.rand(
            total.shape, generator=generator, device=weights.device, dtype=cdf.dtype
        )
    index = torch.searchsorted(cdf, uniform * total, right=True)
    # Rounding can put uniform * total at the total itself; the last index with a weight is
    # where the running sum first reaches the total.
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(index, last).squeeze(-1)


def truncate(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """logits [B, V] with everything outside the top k and outside the top-p nucleus at -inf.

    top_k 0 (or >= V) and top_p 1 keep everything. The nucleus is the smallest set of most likely
    tokens whose probability reaches top_p; the most likely token is always kept.
    """
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # probability of the tokens ranked above each one
        drop_sorted = before >= top_p
        drop_sorted[:, 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def truncate_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """truncate with a top_k [B] and a top_p [B] per row of logits [B, V] (0 and 1: off)."""
    by_k = (top_k > 0) & (top_k < logits.shape[-1])
    if bool(by_k.any()):
        k = torch.where(by_k, top_k, torch.ones_like(top_k))
        kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
        kth = kth.masked_fill(~by_k[:, None], float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    by_p = top_p < 1.0
    if bool(by_p.any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs
        drop_sorted = (before >= top_p.to(probs.dtype)[:, None]) & by_p[:, None]
        drop_sorted[:, 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


# --- sampling inside a captured decode step: no host sync, random numbers from a counter -------


def sample_rows_on_device(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
    *,
    truncating: bool,
    top: int = 0,
) -> Sampled:
    """sample_rows without a host sync, so that a CUDA graph can capture it: the same
    arguments, the same distribution and the same log-probs. Whether any row truncates is
    `truncating`, known to the caller (it knows every row's parameters), where sample_rows asks
    the device. Truncated rows are sampled in sorted order: one sort serves top-k and top-p,
    and the draw is located in the sorted weights, so the same uniform can give another token
    than sample_rows gives (the distribution is the same)."""
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits.dtype)
    scaled = logits / scale[:, None]
    peak = scaled.amax(-1, keepdim=True)
    weights = (scaled - peak).exp_()
    log_normalizer = weights.sum(-1, keepdim=True).log_() + peak
    draw = uniform.to(weights.dtype)[:, None]
    if truncating:
        ordered, order = scaled.sort(dim=-1, descending=True)
        kept = _kept_when_sorted(
            ordered, top_k.masked_fill(greedy, 0), top_p.masked_fill(greedy, 1)
        )
        index = sample_proportional((ordered - peak).exp_() * kept, None, uniform=draw)
        sampled = order.gather(-1, index[:, None]).squeeze(-1)
    else:
        sampled = sample_proportional(weights, None, uniform=draw)
    token_ids = torch.where(greedy, scaled.argmax(-1), sampled)
    logprobs = (scaled.gather(-1, token_ids[:, None]) - log_normalizer).squeeze(-1)
    return Sampled(token_ids, logprobs, top_logprobs(scaled, log_normalizer, top))


def _kept_when_sorted(
    ordered: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Which of the sorted (descending) logits [B, V] truncate_rows keeps, as a float mask
    [B, V] (1 kept, 0 dropped), with top_k [B] (0: off) and top_p [B] (1: off), no host sync."""
    vocabulary = ordered.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocabulary), top_k, torch.full_like(top_k, vocabulary))
    kth = ordered.gather(-1, (k - 1)[:, None])
    by_k = ordered >= kth  # ties with the k-th are kept, as truncate_rows keeps them
    probs = ordered.masked_fill(~by_k, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs  # probability of the tokens ranked above each one
    by_p = (before < top_p.to(probs.dtype)[:, None]) | (top_p >= 1.0)[:, None]
    by_p[:, 0] = True  # the most likely token is always kept
    return (by_k & by_p).to(ordered.dtype)


_MASK32 = 0xFFFFFFFF


def counter_uniform(stream: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """A uniform draw in [0, 1) (float32, 24 random bits) for each row: a hash of the row's
    random stream (int64 [B], >= 0) and the row's counter (int64 [B], >= 0: which of its draws).

    Why a hash and not a torch.Generator: a draw that depends only on (stream, counter) is made
    on the device inside a captured step, and a row then draws the same numbers whatever else is
    in the batch, whichever slot it has and however often the host looks."""
    low, high = stream & _MASK32, (stream >> 32) & _MASK32
    mixed = _mix32(_mix32((counter & _MASK32) ^ low) ^ high)
    return (mixed >> 8).to(torch.float32) * (1.0 / (1 << 24))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of x (int64 holding 32-bit values), a bijection of [0, 2^32)
    whose every output bit depends on every input bit: Wellons' lowbias32 shape with
    TheIronBorn's constants, both below 2^31, so that no product of a 32-bit x reaches 2^63
    (int64 never overflows) and each multiply is one kernel."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def stream_key(seed: int, sample: int) -> int:
    """The random stream (a non-negative int64) of sample `sample` of a request seeded `seed`,
    hashed with counter_uniform's mixer: distinct for the samples of one seed, and 63 bits
    across seeds."""
    a = _mix32_int((seed & _MASK32) ^ 0x243F6A88)
    b = _mix32_int(((seed >> 32) & _MASK32) ^ 0x85A308D3 ^ a)
    low = _mix32_int(a ^ (sample & _MASK32))
    high = _mix32_int(b ^ _mix32_int((sample & _MASK32) ^ 0x13198A2E))
    return ((high & 0x7FFFFFFF) << 32) | low


def _mix32_int(x: int) -> int:
    """_mix32 on a Python int."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & _MASK32
    x ^= x >> 15
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)
