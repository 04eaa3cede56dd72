"""OpenAI's response bodies, and the `rollout` extension every choice carries:

    "rollout": {"prompt_token_ids": [...], "token_ids": [...], "logprobs": [...],
                "finish_reason": "eos" | "stop" | "length", "policy_version": 3}

the exact tokens the model was conditioned on and sampled, their log-probs (float32, under
log_softmax(logits / T) before top-k/top-p truncation, as the learner recomputes them) and the
policy version of the weights, so that an agent episode served here can be trained on. In a
stream it comes in each choice's last chunk.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from rollout.engines.base import Completion
from rollout.serve.protocol import Kind

OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def response_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def rollout_fields(prompt: Sequence[int], completion: Completion) -> dict[str, Any]:
    """The `rollout` extension of one choice."""
    return {
        "prompt_token_ids": list(prompt),
        "token_ids": completion.token_ids,
        "logprobs": completion.logprobs,
        "finish_reason": completion.finish_reason,
        "policy_version": completion.policy_version,
    }


def logprobs_body(
    kind: Kind,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    token_text: Callable[[int], str],
    top: Sequence[Sequence[tuple[int, float]]] | None = None,
) -> dict[str, Any]:
    """OpenAI's logprobs object for sampled tokens and, per token, its alternatives `top`
    ((token id, log-prob), most likely first; None when none were asked for).

    Chat lists exactly the alternatives; completions, as OpenAI's legacy endpoint, map each
    alternative's text to its log-prob and always add the sampled token's.
    """
    texts = [token_text(t) for t in token_ids]
    alternatives = top if top is not None else [[] for _ in token_ids]
    if kind == "chat":
        return {
            "content": [
                {**_token_logprob(text, logprob), "top_logprobs": _chat_top(others, token_text)}
                for text, logprob, others in zip(texts, logprobs, alternatives, strict=True)
            ]
        }
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    tops = []
    for text, logprob, others in zip(texts, logprobs, alternatives, strict=True):
        ranked: dict[str, float] = {}
        for token_id, value in others:
            ranked.setdefault(token_text(token_id), value)  # two ids may decode alike
        ranked.setdefault(text, logprob)
        tops.append(ranked)
    return {
        "tokens": texts,
        "token_logprobs": list(logprobs),
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _token_logprob(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _chat_top(
    alternatives: Sequence[tuple[int, float]], token_text: Callable[[int], str]
) -> list[dict[str, Any]]:
    return [_token_logprob(token_text(token_id), value) for token_id, value in alternatives]


def usage(prompts: Sequence[Sequence[int]], completions: Sequence[Completion]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(kind: Kind, ident: str, model: str, *, chunk: bool) -> dict[str, Any]:
    if kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"
    return {"id": ident, "object": obj, "created": int(time.time()), "model": model}
