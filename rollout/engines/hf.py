"""The embedded engine: batched sampling with a KV cache on a transformers causal LM.

One chunk of up to max_batch_size completions runs at a time: left-padded prompts, one prefill
forward, then one forward per new token that feeds only that token and reuses the cache. The
whole chunk is sampled in one pass per step; rows that finished keep being fed padding and are
ignored. (Continuous batching, refilling finished rows with new prompts, is for later.)

What a Completion carries, precisely (the learner depends on it):
- token_ids are the sampled tokens; an eos token that ended the completion is included (so the
  policy learns to stop), a stop string and the tokens that make it are not.
- logprobs[i] is log_softmax(logits / T)[token_ids[i]] in float32, T the temperature (T=1 when
  greedy), computed BEFORE top-k/top-p truncation: the learner recomputes exactly this from one
  forward over prompt + completion.
- text is the decoded completion without special tokens, cut before the first stop string.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from rollout.engines.base import Completion, EngineStats, FinishReason, SamplingParams

# A character is at most 4 UTF-8 bytes and every token carries at least one byte, so a stop string
# of c characters lies within its last 4c tokens; one more covers a character split across tokens.
_BYTES_PER_CHAR = 4


@dataclass
class _Row:
    """One completion while it is being sampled."""

    prompt_index: int
    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None


class HfEngine:
    """The Engine Protocol (rollout.engines.base) on a transformers model in this process."""

    def __init__(
        self,
        model: Any,
        *,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        tokenizer: Any,
        max_batch_size: int | None = None,
        device: str | torch.device = "cpu",
        seed: int | None = None,
    ) -> None:
        """`model` is used in place (it may be the learner's own module). `seed` seeds the
        engine's generator, used when SamplingParams.seed is None; None draws a random seed."""
        if not eos_token_ids:
            raise ValueError("eos_token_ids is empty: the engine needs a token that ends a turn")
        self._model = model
        self._eos = frozenset(eos_token_ids)
        self._pad = pad_token_id
        self._tokenizer = tokenizer
        self._max_batch_size = max_batch_size
        self._device = torch.device(device)
        self._generator = torch.Generator(self._device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._version = 0
        self._stats = EngineStats()

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def stats(self) -> EngineStats:
        return self._stats

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        """`params.n` completions per prompt, grouped by prompt (prompt 0's n first)."""
        if any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("a prompt has no tokens: every prompt needs at least one")
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(self._device).manual_seed(params.seed)
        rows = [
            _Row(index, list(prompt))
            for index, prompt in enumerate(prompts)
            for _ in range(params.n)
        ]
        size = self._max_batch_size or max(len(rows), 1)
        start = time.perf_counter()
        with _eval_mode(self._model), torch.inference_mode():
            for begin in range(0, len(rows), size):
                self._sample(rows[begin : begin + size], params, generator)
        self._stats.seconds += time.perf_counter() - start
        self._stats.prompt_tokens += sum(len(row.prompt) for row in rows)
        self._stats.generated_tokens += sum(len(row.token_ids) for row in rows)
        return [self._completion(row, params) for row in rows]

    def generate_one(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[Completion]:
        """The `params.n` completions of one prompt."""
        return self.generate([prompt_ids], params)

    def load_weights(self, weights: Mapping[str, torch.Tensor] | None, version: int) -> None:
        """New weights from the learner; None when the module is shared and already up to date."""
        if weights is not None:
            self._model.load_state_dict(dict(weights), strict=True)
        self._version = version

    def close(self) -> None:
        """Nothing to release: the model belongs to the caller."""

    # --- sampling --------------------------------------------------------------------------------

    def _sample(self, rows: list[_Row], params: SamplingParams, generator: torch.Generator) -> None:
        """Fill in the rows' tokens, log-probs and finish reasons: one prefill, then one step per
        new token until every row has finished or max_new_tokens is reached."""
        input_ids, attention_mask = left_pad([row.prompt for row in rows], self._pad, self._device)
        # Left padding shifts each prompt right; positions count real tokens only, so every row
        # sees the positions it would see alone (and that the learner's right-padded forward uses).
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self._model.config)
        logits = self._forward(input_ids, attention_mask, position_ids, cache)
        for step in range(params.max_new_tokens):
            token_ids, logprobs = sample_tokens(logits, params, generator)
            self._record(rows, token_ids.tolist(), logprobs.tolist(), params.stop)
            active = [row.finish_reason is None for row in rows]
            if not any(active) or step == params.max_new_tokens - 1:
                break
            # Finished rows are fed padding: their outputs are ignored from here on.
            feed = token_ids.masked_fill(~torch.tensor(active, device=self._device), self._pad)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], 1)
            position_ids = position_ids[:, -1:] + 1
            logits = self._forward(feed[:, None], attention_mask, position_ids, cache)
        for row in rows:
            if row.finish_reason is None:
                row.finish_reason = "length"

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
    ) -> torch.Tensor:
        """Logits for the next token, float32 [B, V], from input_ids [B, S] after the cache.

        attention_mask [B, cached + S] covers the cache too; position_ids is [B, S].
        """
        output = self._model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,  # the prefill needs only the last position's [B, V], not [B, S, V]
        )
        return output.logits[:, -1].float()

    def _record(
        self, rows: list[_Row], token_ids: list[int], logprobs: list[float], stop: tuple[str, ...]
    ) -> None:
        """Append one sampled token to each unfinished row and note the rows that just finished."""
        for row, token_id, logprob in zip(rows, token_ids, logprobs, strict=True):
            if row.finish_reason is not None:
                continue
            row.token_ids.append(token_id)
            row.logprobs.append(logprob)
            if token_id in self._eos:
                row.finish_reason = "eos"
            elif stop and self._ends_with_stop(row.token_ids, stop):
                row.finish_reason = "stop"

    def _ends_with_stop(self, token_ids: list[int], stop: tuple[str, ...]) -> bool:
        """Whether the newest token completed a stop string. Earlier tokens were checked at their
        own step, so only the last few tokens' text needs decoding."""
        window = _BYTES_PER_CHAR * max(len(s) for s in stop) + 1
        tail = self._decode(token_ids[-window:])
        return any(s in tail for s in stop)

    # --- results ---------------------------------------------------------------------------------

    def _completion(self, row: _Row, params: SamplingParams) -> Completion:
        assert row.finish_reason is not None
        token_ids, logprobs = row.token_ids, row.logprobs
        if row.finish_reason == "stop":
            keep, text = cut_at_stop(token_ids, params.stop, self._decode)
            token_ids, logprobs = token_ids[:keep], logprobs[:keep]
        else:
            text = self._decode(token_ids)
        return Completion(
            prompt_index=row.prompt_index,
            token_ids=token_ids,
            logprobs=logprobs,
            text=text,
            finish_reason=row.finish_reason,
            policy_version=self._version,
        )

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits [B, V]: (token ids [B], their log-probs [B]).

    The log-prob is under log_softmax(logits / T) before top-k/top-p truncation; temperature 0
    is greedy and reports T=1 log-probs.
    """
    scaled = logits / (params.temperature if params.temperature > 0 else 1.0)
    if params.temperature > 0:
        truncated = truncate(scaled, top_k=params.top_k, top_p=params.top_p)
        token_ids = torch.multinomial(truncated.softmax(-1), 1, generator=generator).squeeze(-1)
    else:
        token_ids = scaled.argmax(-1)
    logprobs = scaled.log_softmax(-1).gather(-1, token_ids[:, None]).squeeze(-1)
    return token_ids, logprobs


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


def left_pad(
    prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts padded on the left to one width: (input_ids [B, P], attention_mask [B, P])."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def cut_at_stop(
    token_ids: Sequence[int], stop: Sequence[str], decode: Callable[[Sequence[int]], str]
) -> tuple[int, str]:
    """Cut a completion before its first stop string: (tokens to keep, text before the stop).

    Keeps the longest prefix of token_ids whose text lies within the text before the stop. When
    a token straddles the start of the stop string, it is dropped and the text keeps its first
    part, so the text can then run a few characters past decode(token_ids[:keep]).
    """
    text = decode(token_ids)
    found = [at for at in (text.find(s) for s in stop) if at >= 0]
    if not found:
        return len(token_ids), text
    text = text[: min(found)]
    keep = len(token_ids)
    while keep and not text.startswith(decode(token_ids[:keep])):
        keep -= 1
    return keep, text


@contextmanager
def _eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Eval mode for the duration, then the module's previous mode back.

    The engine may share the learner's module, which is in train mode between steps; in train mode
    dropout would perturb the samples and gradient checkpointing would turn the KV cache off.
    """
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)
