"""HfEngine: the Engine Protocol (rollout.engines.base) on a transformers causal LM in this process.

`generate()`, the batch API the trainer uses, queues its rows in a DecodeBatch of fixed width
(max_batch_size, or all rows) and steps it until it drains: when every row fits, that is one
static batch. EngineService (rollout.engines.service) drives the pieces instead (`rows`,
`decode_batch`, `completion`), stepping one DecodeBatch of adaptive width in a background thread.

On a CUDA device a Llama-family model decodes statically instead (StaticDecodeBatch over a
StaticDecoder: a slotted cache allocated once, a decode step of fixed shapes captured in a CUDA
graph per width bucket, sampling on the device, the host reading tokens every few steps); the
decoder, its cache and its graphs live as long as the engine. Other models, and the CPU, take
the DecodeBatch path.

What a Completion carries, precisely (the learner depends on it):
- token_ids are the sampled tokens; an eos token that ended the completion is included (so the
  policy learns to stop), a stop string and the tokens that make it are not.
- logprobs[i] is log_softmax(logits / T)[token_ids[i]] in float32, T the temperature (T=1 when
  greedy), computed BEFORE top-k/top-p truncation: the learner recomputes exactly this from one
  forward over prompt + completion.
- text is the decoded completion without special tokens, cut before the first stop string.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import DynamicCache

from rollout.engines.base import (
    Completion,
    EngineStats,
    SamplingParams,
    cache_keyword,
    cut_at_stop,
)
from rollout.engines.hf.decode_batch import DecodeBatch, Decoder, GenerationRow, Listener
from rollout.engines.hf.llama_decoder import LlamaDecoder
from rollout.engines.hf.packing import (
    PACK_MIN_NEW_TOKENS,
    packed_width,
    packing_kernel,
    should_pack,
)
from rollout.engines.hf.static_batch import StaticDecodeBatch
from rollout.engines.hf.static_step import StaticDecoder, supports_static
from rollout.engines.sampling import stream_key

# A character is at most 4 UTF-8 bytes and every token carries at least one byte, so a stop string
# of c characters lies within its last 4c tokens; one more covers a character split across tokens.
_BYTES_PER_CHAR = 4


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
        keep_packed: bool = False,
        cuda_graphs: bool | None = None,
        static: bool | None = None,
        max_context: int | None = None,
    ) -> None:
        """`model` is used in place (it may be the learner's own module). `seed` seeds the
        engine's generator, used when SamplingParams.seed is None; None draws a random seed.

        `keep_packed` keeps the packed weights of generate()'s last batch width from one call to
        the next until load_weights: for serving and batch inference, where the weights do not
        change, packing (about 0.65 s for SmolLM2) is paid once. Off for training, where the
        weights change after every call and the copy would sit beside the learner's memory.

        `static` decodes through the static step (module docstring): None where the device is
        CUDA and the model a Llama-family one, True also elsewhere (the step then runs eagerly:
        tests, benchmarks), False never. `cuda_graphs` captures that step in CUDA graphs: None
        on CUDA, True requires CUDA and a model the static step serves, False runs it eagerly.
        `max_context` (prompt + completion tokens) sizes the static cache from the start, so
        that no later call grows it (growing recaptures the graphs); None grows it on demand."""
        if not eos_token_ids:
            raise ValueError("eos_token_ids is empty: the engine needs a token that ends a turn")
        self._device = torch.device(device)
        if cuda_graphs and self._device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device, not {self._device}")
        if cuda_graphs and static is False:
            raise ValueError("cuda_graphs=True captures the static step: static=False refuses it")
        if (cuda_graphs or static) and not supports_static(model):
            raise ValueError(
                "the static decode step serves Llama-family models (llama, mistral, qwen2) with "
                "full attention, plain linear layers and a fixed rotary table; this model is "
                f"{getattr(model.config, 'model_type', type(model).__name__)!r}: leave "
                "cuda_graphs unset (auto) to decode it with its own forward"
            )
        on_cuda = self._device.type == "cuda"
        self._static_mode = static if static is not None else bool(cuda_graphs) or on_cuda
        self._graphs = cuda_graphs if cuda_graphs is not None else on_cuda
        self._max_context = max_context
        self._static: StaticDecoder | None = None
        self._static_weights = 0
        """The load_weights count the static decoder's stacked copies were made at."""
        self._model = model
        self._cache_keyword = cache_keyword(model)
        self._eos = frozenset(eos_token_ids)
        self._pad = pad_token_id
        self._tokenizer = tokenizer
        self._max_batch_size = max_batch_size
        self._generator = torch.Generator(self._device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._version = 0
        self._keep_packed = keep_packed
        self._kept: tuple[tuple[int, int | None], Decoder] | None = None
        """(weights generation, packed_width) -> the decoder whose packed weights are kept."""
        self._weights_loaded = 0
        """Counts load_weights calls: a DecodeBatch drops its packed weights when it moves."""
        self._stats = EngineStats()

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def model(self) -> Any:
        return self._model

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_batch_size(self) -> int | None:
        return self._max_batch_size

    @property
    def context_length(self) -> int | None:
        """The most positions (prompt + completion) the model takes, if its config says."""
        return getattr(self._model.config, "max_position_embeddings", None)

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
            GenerationRow(index, list(prompt), params, generator)
            for index, prompt in enumerate(prompts)
            for _ in range(params.n)
        ]
        if not rows:
            return []
        width = min(self._max_batch_size or len(rows), len(rows))
        batch: DecodeBatch | StaticDecodeBatch
        if self._uses_static():
            self._give_streams(rows, params)
            batch = StaticDecodeBatch(self, max_width=width)
        else:
            pack = should_pack(self._model, params.max_new_tokens)
            batch = DecodeBatch(self, width=width, pack=pack)
        batch.add(rows)
        with eval_mode(self._model), torch.inference_mode():
            while batch.busy:
                batch.step()
        return [self.completion(row) for row in rows]

    def generate_one(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[Completion]:
        """The `params.n` completions of one prompt."""
        return self.generate([prompt_ids], params)

    def load_weights(self, weights: Mapping[str, torch.Tensor] | None, version: int) -> None:
        """New weights from the learner; None when the module is shared and already up to date."""
        if weights is not None:
            self._model.load_state_dict(dict(weights), strict=True)
        self._version = version
        self._weights_loaded += 1

    def close(self) -> None:
        """Nothing to release: the model belongs to the caller."""

    # --- the pieces a scheduler drives (EngineService) ---------------------------------------------

    def rows(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt_index: int = 0,
        listener: Listener | None = None,
    ) -> list[GenerationRow]:
        """The `params.n` rows of one prompt, ready for DecodeBatch.add. A seeded request gets a
        generator of its own; an unseeded one draws from the engine's."""
        if not prompt_ids:
            raise ValueError("a prompt has no tokens: every prompt needs at least one")
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(self._device).manual_seed(params.seed)
        rows = [
            GenerationRow(prompt_index, list(prompt_ids), params, generator, listener)
            for _ in range(params.n)
        ]
        if self._uses_static():
            self._give_streams(rows, params)
        return rows

    def decode_batch(self, max_width: int) -> DecodeBatch | StaticDecodeBatch:
        """A batch of adaptive width, at most `max_width` rows, keeping its packed weights
        between steps (until load_weights): for a long-lived scheduler."""
        if self._uses_static():
            return StaticDecodeBatch(self, max_width=max_width)
        pack = should_pack(self._model, PACK_MIN_NEW_TOKENS)
        return DecodeBatch(self, width=None, max_width=max_width, pack=pack)

    def completion(self, row: GenerationRow) -> Completion:
        """The finished row as the Completion that callers and the learner see."""
        assert row.finish_reason is not None
        token_ids, logprobs, top = row.token_ids, row.logprobs, row.top_logprobs
        if row.finish_reason == "stop":
            keep, text = cut_at_stop(token_ids, row.params.stop, self._decode)
            token_ids, logprobs, top = token_ids[:keep], logprobs[:keep], top[:keep]
        else:
            text = self._decode(token_ids)
        return Completion(
            prompt_index=row.prompt_index,
            token_ids=list(token_ids),
            logprobs=list(logprobs),
            text=text,
            finish_reason=row.finish_reason,
            policy_version=self._version,
            top_logprobs=list(top) if row.params.top_logprobs else None,
        )

    # --- the static path ---------------------------------------------------------------------------

    def _uses_static(self) -> bool:
        """Whether rows decode through the static step (the model is asked each time: a hook
        or an adapter added since would make the step skip what the model computes)."""
        return self._static_mode and supports_static(self._model)

    def _give_streams(self, rows: Sequence[GenerationRow], params: SamplingParams) -> None:
        """Each row's random stream for the static step: from the seed and the row's index
        among those of the call (or request) when seeded, else drawn from the engine's generator
        (reproducible given the engine's seed and the order of calls)."""
        if params.seed is not None:
            streams = [stream_key(params.seed, index) for index in range(len(rows))]
        else:
            streams = torch.randint(
                0, 2**62, (len(rows),), generator=self._generator, device=self._device
            ).tolist()
        for row, stream in zip(rows, streams, strict=True):
            row.stream = stream

    def _static_decoder(self, width: int, capacity: int) -> StaticDecoder:
        """The engine's static decoder, with room for `width` rows of `capacity` columns,
        reading the model's current weights. Made again (cache and graphs) when the model's
        dtype changed; a parameter that moved makes it recapture its graphs."""
        decoder = self._static
        if decoder is None or decoder.dtype != self._model.lm_head.weight.dtype:
            self._static = None  # the old cache goes before the new one is allocated
            decoder = self._static = StaticDecoder(
                self._model,
                width=max(width, self._max_batch_size or 0),
                capacity=max(capacity, self._max_context or 0),
                device=self._device,
                graphs=self._graphs,
            )
            self._static_weights = self._weights_loaded
            return decoder
        decoder.resize(width, capacity)
        decoder.follow_weights(reloaded=self._static_weights != self._weights_loaded)
        self._static_weights = self._weights_loaded
        return decoder

    # --- what a DecodeBatch calls ------------------------------------------------------------------

    def _decoder(self, cache: DynamicCache, width: int, pack: bool) -> Decoder:
        """The decode step for a batch of `width` rows. A Llama-family model gets its step
        written out here (LlamaDecoder); any other model runs its own forward."""
        if LlamaDecoder.supports(self._model, cache):
            kernel = packing_kernel() if pack else None
            if kernel is None or not self._keep_packed:
                return LlamaDecoder(self._model, width, kernel=kernel)
            key = (self._weights_loaded, packed_width(width))
            if self._kept is None or self._kept[0] != key:
                self._kept = None  # the old packed copy goes before the new one is made
                self._kept = (key, LlamaDecoder(self._model, width, kernel=kernel))
            return self._kept[1]

        def step(
            token_ids: torch.Tensor,
            position_ids: torch.Tensor,
            mask: torch.Tensor,
            cache: DynamicCache,
        ) -> torch.Tensor:
            return self._forward(token_ids[:, None], mask, position_ids, cache)

        return step

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
            **{self._cache_keyword: cache},
            use_cache=True,
            logits_to_keep=1,  # the prefill needs only the last position's [B, V], not [B, S, V]
        )
        return output.logits[:, -1].float()

    def _record(
        self,
        row: GenerationRow,
        token_id: int,
        logprob: float,
        top: list[tuple[int, float]] | None = None,
    ) -> None:
        """Append one sampled token (and the batch's most likely tokens for its row, of which it
        keeps as many as it asked for) to the row and note whether it finished the row."""
        row.token_ids.append(token_id)
        row.logprobs.append(logprob)
        if row.params.top_logprobs and top is not None:
            row.top_logprobs.append(top[: row.params.top_logprobs])
        if token_id in self._eos:
            row.finish_reason = "eos"
        elif row.params.stop and self._ends_with_stop(row.token_ids, row.params.stop):
            row.finish_reason = "stop"
        elif len(row.token_ids) >= row.params.max_new_tokens:
            row.finish_reason = "length"

    def _ends_with_stop(self, token_ids: list[int], stop: tuple[str, ...]) -> bool:
        """Whether the newest token completed a stop string. Earlier tokens were checked at their
        own step, so only the last few tokens' text needs decoding."""
        window = _BYTES_PER_CHAR * max(len(s) for s in stop) + 1
        tail = self._decode(token_ids[-window:])
        return any(s in tail for s in stop)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


@contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
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
