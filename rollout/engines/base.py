"""The generation Protocol every engine implements (hf, vllm, engine plugins), the types it speaks, and the
rule both engines cut a completion at a stop string by (cut_at_stop).

Batch-first: an engine takes many prompts (as token ids) and returns one result per completion.
Engines import torch and their backend; they never see config objects: the runtime turns the
plan's generation settings into SamplingParams.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "eos"]
"""stop: a stop string was produced (and cut off); length: max_new_tokens reached; eos: the model
ended the sequence itself."""

DEFAULT_BATCH_SIZE = {"hf": 32, "vllm": 256}
"""Completions decoded at once when neither a flag nor generation.max_batch_size says (rollout
generate, rollout eval, eval suites in training). 32 is where the hf engine's tokens/s on a CPU
stops growing much (benchmarks/README.md)."""


def default_batch_size(engine: str) -> int:
    """DEFAULT_BATCH_SIZE of a built-in engine; an engine plugin gets the hf engine's."""
    return DEFAULT_BATCH_SIZE.get(engine, DEFAULT_BATCH_SIZE["hf"])


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    n: int = 1
    """Completions per prompt; results come grouped: prompt 0's n completions first."""
    seed: int | None = None
    """Seed for this call's sampling stream; None draws from the engine's own generator."""
    top_logprobs: int = 0
    """Alternatives to report per sampled token: its `top_logprobs` most likely tokens (0: none,
    and nothing is computed for them)."""


@dataclass(frozen=True)
class Completion:
    prompt_index: int
    token_ids: list[int]
    """Sampled tokens; the eos token is included when finish_reason is "eos"; tokens of a stop
    string are removed; never padding."""
    logprobs: list[float]
    """float32 log_softmax(logits / T)[token] for each token, before top-k/top-p truncation
    (T = 1 when greedy). The learner recomputes exactly this, so the two must agree."""
    text: str
    """Decoded without special tokens, cut before the first stop string."""
    finish_reason: FinishReason
    policy_version: int = 0
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """For each token, the SamplingParams.top_logprobs most likely (token id, log-prob), most
    likely first, under the same distribution as `logprobs`; None when none were asked for."""


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class Engine(Protocol):
    """A generation backend. Five methods; everything else is the engine's own business."""

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        """Sample ``params.n`` completions for each prompt (token ids, no padding)."""
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor] | None, version: int) -> None:
        """Take the learner's new weights; later completions carry ``version``.

        ``None`` means the engine shares the learner's module (colocated hf engine): the weights
        are already in place, only the version moves and any derived cache is dropped.
        """
        ...

    @property
    def policy_version(self) -> int: ...

    @property
    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a transformers model's forward takes its KV cache by: `cache` from
    transformers 5.2x on (where `past_key_values` still works, with a deprecation warning at
    every call site), `past_key_values` before."""
    import inspect

    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


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
