"""The vLLM engine: the Engine Protocol on vLLM's offline `LLM`, for machines with a CUDA GPU.

vllm is imported only when a VllmEngine is constructed, never when this module (or anything else
in rollout) is imported: a CPU machine without vllm imports, plans and tests everything else.
`rollout plan` refuses `generation.engine = "vllm"` without a CUDA device or the package.

What a Completion carries is exactly what the hf engine gives (rollout.engines.base), so the
learner cannot tell the engines apart:
- token_ids are vLLM's sampled tokens; an end-of-sequence token that ended the completion is
  included (every id the hf engine treats as eos is passed to vLLM as a stop token id), and a
  stop string's tokens are cut off with `cut_at_stop`, as the hf engine cuts them.
- logprobs come from vLLM with `logprobs_mode = "processed_logprobs"` (vLLM >= 0.10.2): the
  sampled token's log-probability after temperature scaling. That is the hf engine's
  log_softmax(logits / T) when top_k and top_p are off. With top_k or top_p on, vLLM reports the
  log-probability after truncation (renormalized over the kept tokens) where the hf engine
  reports it before: the two then differ, and the learner recomputes the hf definition.
- top_logprobs (SamplingParams.top_logprobs = N) is vLLM's `logprobs = N`: each position's N most
  likely tokens, with log-probs of the same kind as the sampled token's.
- text is decoded by vLLM's tokenizer without special tokens, cut before the first stop string.

Weights from the learner are pushed into the model vLLM runs, in place, through
`LLM.apply_model`: each (name, tensor) pair in Hugging Face naming goes to the vLLM model's own
`load_weights`, which fuses q/k/v and gate/up as that model needs. The function runs in this
process: the engine sets VLLM_ENABLE_V1_MULTIPROCESSING=0 before vllm starts, so no tensor is
ever pickled to another process. One GPU per engine (tensor_parallel_size = 1).

Verified: the mapping from vLLM's outputs to Completions (tests/unit/test_vllm_engine.py, on
plain dataclasses shaped like vLLM's RequestOutput). Not verified: anything that needs vllm and a
GPU (construction, generation, the weight update); see docs/vllm.md.
"""

from __future__ import annotations

import gc
import os
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from rollout.engines.base import (
    Completion,
    EngineStats,
    FinishReason,
    SamplingParams,
    cut_at_stop,
)

if TYPE_CHECKING:
    import torch

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
LOGPROBS_MODE = "processed_logprobs"
_SEED_SPACE = 2**31


class VllmEngine:
    """The Engine Protocol (rollout.engines.base) on a vLLM `LLM` in this process."""

    def __init__(
        self,
        model: str,
        *,
        eos_token_ids: Sequence[int],
        tokenizer: str | None = None,
        dtype: str = "auto",
        seed: int | None = None,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        enforce_eager: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        """`model` is a local Hugging Face model directory (config.json and safetensors);
        `eos_token_ids` every id that ends a completion (as rollout.models.loading finds them).
        `seed` seeds vLLM and the engine's own seed stream (used when SamplingParams.seed is
        None). Other keyword arguments go to vllm.LLM unchanged."""
        if not eos_token_ids:
            raise ValueError("eos_token_ids is empty: the engine needs a token that ends a turn")
        if os.environ.setdefault(MULTIPROCESSING_ENV, "0") != "0":
            raise ValueError(
                f"{MULTIPROCESSING_ENV}={os.environ[MULTIPROCESSING_ENV]} runs vLLM's engine in "
                "another process, where weight updates would have to be pickled; unset it"
            )
        import vllm  # only here: everything else in rollout works without vllm

        arguments: dict[str, Any] = {
            "model": model,
            "tokenizer": tokenizer,
            "dtype": dtype,
            "seed": seed if seed is not None else 0,
            "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": 1,
            "enforce_eager": enforce_eager,
            "logprobs_mode": LOGPROBS_MODE,
            **llm_kwargs,
        }
        if max_model_len is not None:
            arguments["max_model_len"] = max_model_len
        if max_num_seqs is not None:
            arguments["max_num_seqs"] = max_num_seqs
        self._vllm = vllm
        self._llm = vllm.LLM(**arguments)
        self._tokenizer = self._llm.get_tokenizer()
        self._eos = list(dict.fromkeys(eos_token_ids))
        self._seeds = random.Random(seed)
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
        seed = params.seed if params.seed is not None else self._seeds.randrange(_SEED_SPACE)
        requests = [{"prompt_token_ids": list(prompt)} for prompt in prompts]
        sampling = [
            self._vllm.SamplingParams(**vllm_sampling_arguments(params, seed, index, self._eos))
            for index in range(len(prompts))
        ]
        start = time.perf_counter()
        outputs = self._llm.generate(requests, sampling, use_tqdm=False)
        self._stats.seconds += time.perf_counter() - start
        completions = completions_from_outputs(
            outputs, params, decode=self._decode, version=self._version
        )
        self._stats.prompt_tokens += sum(len(prompt) for prompt in prompts) * params.n
        self._stats.generated_tokens += sum(len(c.token_ids) for c in completions)
        return completions

    def load_weights(self, weights: Mapping[str, torch.Tensor] | None, version: int) -> None:
        """Copy the learner's tensors (Hugging Face names) into vLLM's model, in place."""
        if weights is None:
            raise ValueError(
                "the vllm engine keeps its own copy of the model: pass the learner's weights "
                "(a name -> tensor mapping), not None"
            )
        pairs = list(weights.items())

        def load(model: Any) -> None:
            model.load_weights(iter(pairs))

        self._llm.apply_model(load)
        # Cached prefixes hold keys and values computed by the old weights.
        self._llm.reset_prefix_cache()
        self._version = version

    def close(self) -> None:
        """Release vLLM's GPU memory (weights and KV cache)."""
        llm = self.__dict__.pop("_llm", None)
        if llm is None:
            return
        del llm
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


def vllm_sampling_arguments(
    params: SamplingParams, seed: int, prompt_index: int, eos_token_ids: Sequence[int]
) -> dict[str, Any]:
    """Keyword arguments of vllm.SamplingParams for one prompt of a generate call.

    Each prompt gets its own seed (vLLM gives a prompt's n samples seed, seed + 1, ...), so two
    identical prompts in one call still get different samples, as they do in the hf engine.
    """
    return {
        "n": params.n,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # -1: off, in every vLLM version
        "seed": (seed + prompt_index * params.n) % _SEED_SPACE,
        "stop": list(params.stop) or None,
        "stop_token_ids": list(eos_token_ids),
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        # The sampled token's log-prob always; with N > 0, the N most likely tokens' too.
        "logprobs": params.top_logprobs,
    }


# --- vLLM outputs -> Completions (pure; tested without vllm) --------------------------------------


class LogprobLike(Protocol):
    logprob: float


class CompletionOutputLike(Protocol):
    """The fields of vllm.outputs.CompletionOutput that the mapping reads."""

    index: int
    token_ids: Sequence[int]
    logprobs: Sequence[Mapping[int, LogprobLike]] | None
    finish_reason: str | None
    stop_reason: int | str | None


class RequestOutputLike(Protocol):
    """The fields of vllm.outputs.RequestOutput that the mapping reads."""

    outputs: Sequence[CompletionOutputLike]


def completions_from_outputs(
    outputs: Iterable[RequestOutputLike],
    params: SamplingParams,
    *,
    decode: Callable[[Sequence[int]], str],
    version: int,
) -> list[Completion]:
    """One Completion per sample, grouped by prompt in `outputs` order (vLLM returns one
    RequestOutput per prompt, in the order the prompts were given)."""
    completions = []
    for prompt_index, request in enumerate(outputs):
        samples = sorted(request.outputs, key=lambda sample: sample.index)
        if len(samples) != params.n:
            raise RuntimeError(
                f"vLLM returned {len(samples)} completions for prompt {prompt_index}, "
                f"expected n = {params.n}"
            )
        completions += [
            completion_from_output(prompt_index, sample, params, decode=decode, version=version)
            for sample in samples
        ]
    return completions


def completion_from_output(
    prompt_index: int,
    sample: CompletionOutputLike,
    params: SamplingParams,
    *,
    decode: Callable[[Sequence[int]], str],
    version: int,
) -> Completion:
    """One vLLM sample as a Completion: the hf engine's finish reasons, stop cutting and text."""
    token_ids = list(sample.token_ids)
    logprobs = sampled_logprobs(sample, token_ids)
    top = top_logprobs(sample, params.top_logprobs) if params.top_logprobs else None
    reason = finish_reason(sample)
    if reason == "stop":
        keep, text = cut_at_stop(token_ids, params.stop, decode)
        token_ids, logprobs = token_ids[:keep], logprobs[:keep]
        top = top[:keep] if top is not None else None
    else:
        text = decode(token_ids)
    return Completion(
        prompt_index=prompt_index,
        token_ids=token_ids,
        logprobs=logprobs,
        text=text,
        finish_reason=reason,
        policy_version=version,
        top_logprobs=top,
    )


def finish_reason(sample: CompletionOutputLike) -> FinishReason:
    """vLLM says "stop" both for a stop string (stop_reason is the string) and for an end token
    (stop_reason is its id, or None for the tokenizer's eos); rollout tells them apart."""
    if sample.finish_reason == "length":
        return "length"
    if sample.finish_reason == "stop":
        return "stop" if isinstance(sample.stop_reason, str) else "eos"
    raise RuntimeError(
        f"vLLM returned an unfinished completion (finish_reason {sample.finish_reason!r})"
    )


def sampled_logprobs(sample: CompletionOutputLike, token_ids: Sequence[int]) -> list[float]:
    """The log-prob of each sampled token, from vLLM's per-position {token id: Logprob}."""
    if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
        raise RuntimeError(
            "vLLM returned no log-prob for some sampled tokens (SamplingParams.logprobs = 0 "
            "asks for one per token)"
        )
    return [
        float(step[token].logprob) for step, token in zip(sample.logprobs, token_ids, strict=True)
    ]


def top_logprobs(sample: CompletionOutputLike, count: int) -> list[list[tuple[int, float]]]:
    """The `count` most likely (token id, log-prob) of each position, most likely first. vLLM's
    {token id: Logprob} holds them and the sampled token, which may rank below them."""
    assert sample.logprobs is not None  # sampled_logprobs checked it
    return [
        sorted(((t, float(p.logprob)) for t, p in step.items()), key=lambda x: -x[1])[:count]
        for step in sample.logprobs
    ]
