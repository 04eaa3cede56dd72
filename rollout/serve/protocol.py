"""The OpenAI wire format: requests checked into engine terms, results into response bodies.

Every problem with a request becomes an ApiError: an HTTP status (4xx) and OpenAI's error shape,
{"error": {"message", "type", "param", "code"}}, where param names the offending field.

The `rollout` extension: every choice also carries

    "rollout": {"prompt_token_ids": [...], "token_ids": [...], "logprobs": [...],
                "finish_reason": "eos" | "stop" | "length", "policy_version": 3}

the exact tokens the model was conditioned on and sampled, their log-probs (float32, under
log_softmax(logits / T) before top-k/top-p truncation, as the learner recomputes them) and the
policy version of the weights, so that an agent episode served here can be trained on. In a
stream it comes in each choice's last chunk.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from rollout.engines.base import Completion, SamplingParams

MAX_N = 16
"""Most completions per prompt."""
MAX_PROMPTS = 64
"""Most prompts in one /v1/completions request."""
MAX_STOP = 4
"""Most stop strings, as OpenAI allows."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per token in chat (top_logprobs), as OpenAI allows."""
MAX_COMPLETION_LOGPROBS = 5
"""Most alternatives per token in completions (logprobs: N), as OpenAI allows."""
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

Kind = Literal["completion", "chat"]


class ApiError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class Defaults:
    """What a request leaves out: the config's [generation] section, or these."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    """What the protocol needs to know about the served model."""

    name: str
    context_length: int | None
    vocab_size: int
    encode: Callable[[str], list[int]]
    """Text -> token ids, for a completion prompt."""
    chat_encode: Callable[[list[dict[str, Any]]], list[int]] | None
    """Messages -> token ids with the chat template applied; None without a template."""
    defaults: Defaults = field(default_factory=Defaults)


@dataclass(frozen=True)
class GenerationRequest:
    kind: Kind
    prompts: list[list[int]]
    """One for chat; one or more for completions. Each is sampled params.n times."""
    params: SamplingParams
    stream: bool
    logprobs: bool
    """Whether choices carry OpenAI's logprobs object; params.top_logprobs says how many
    alternatives each token lists."""
    include_usage: bool
    """stream_options.include_usage: a last chunk with the usage counts."""


def parse_request(kind: Kind, body: Any, model: ModelInfo) -> GenerationRequest:
    """Check a /v1/completions or /v1/chat/completions body against the served model."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str):
        raise ApiError(400, "'model' is required: a string naming the model", param="model")
    if name != model.name:
        raise ApiError(
            404,
            f"the model {name!r} does not exist: this server serves {model.name!r}",
            param="model",
            code="model_not_found",
        )
    if kind == "chat":
        if model.chat_encode is None:
            raise ApiError(
                400,
                "the model has no chat template: use /v1/completions, or serve it with a chat "
                "template (model.chat_template in the config)",
                param="messages",
            )
        prompts = [_chat_prompt(body.get("messages"), model.chat_encode)]
    else:
        prompts = _completion_prompts(body.get("prompt"), model)
    n = _integer(body, "n", 1, low=1, high=MAX_N)
    max_tokens = _max_tokens(kind, body, model, prompts)
    temperature = _number(body, "temperature", model.defaults.temperature, low=0.0, high=2.0)
    top_p = _number(body, "top_p", model.defaults.top_p, low=0.0, high=1.0)
    if top_p == 0:
        raise ApiError(400, "'top_p' must be greater than 0", param="top_p")
    top_k = _integer(body, "top_k", model.defaults.top_k, low=0, high=None)
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = bool(stream and options and options.get("include_usage") is True)
    if kind == "chat":
        logprobs = _boolean(body, "logprobs", False)
        top_logprobs = _integer(body, "top_logprobs", 0, low=0, high=MAX_TOP_LOGPROBS)
        if top_logprobs and not logprobs:
            raise ApiError(
                400, "'top_logprobs' needs 'logprobs': true as well", param="top_logprobs"
            )
    else:
        requested = _integer(body, "logprobs", None, low=0, high=MAX_COMPLETION_LOGPROBS)
        logprobs, top_logprobs = requested is not None, requested or 0
    seed = _integer(body, "seed", None, low=None, high=None)
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=_stop(body.get("stop"), model.defaults.stop),
        n=n,
        seed=seed,
        top_logprobs=top_logprobs,
    )
    return GenerationRequest(kind, prompts, params, stream, logprobs, include_usage)


def per_prompt(request: GenerationRequest, index: int) -> SamplingParams:
    """The sampling parameters of prompt `index`: a seed gives each prompt its own stream."""
    params = request.params
    return params if params.seed is None else replace(params, seed=params.seed + index)


# --- fields ----------------------------------------------------------------------------------------


def _completion_prompts(prompt: Any, model: ModelInfo) -> list[list[int]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of those lists."""
    if isinstance(prompt, str):
        prompts = [model.encode(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [model.encode(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [list(prompt)]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt)
    ):
        prompts = [list(p) for p in prompt]
    else:
        raise ApiError(
            400,
            "'prompt' must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids",
            param="prompt",
        )
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    for ids in prompts:
        if not ids:
            raise ApiError(400, "a prompt has no tokens", param="prompt")
        if any(not 0 <= t < model.vocab_size for t in ids):
            raise ApiError(400, f"token ids must lie in [0, {model.vocab_size})", param="prompt")
    return prompts


def _chat_prompt(
    messages: Any, chat_encode: Callable[[list[dict[str, Any]]], list[int]]
) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    checked = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object", param=where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(
                400, f"{where}.role must be one of {sorted(CHAT_ROLES)}", param=f"{where}.role"
            )
        checked.append({"role": role, "content": _content(message.get("content"), where)})
    try:
        ids = chat_encode(checked)
    except Exception as error:  # the template's own complaint, e.g. roles out of order
        raise ApiError(
            400, f"the chat template refused the messages: {error}", param="messages"
        ) from None
    if not ids:
        raise ApiError(400, "the messages make an empty prompt", param="messages")
    return ids


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    raise ApiError(
        400,
        f"{where}.content must be a string or a list of text parts (other content is not "
        "supported)",
        param=f"{where}.content",
    )


def _max_tokens(
    kind: Kind, body: dict[str, Any], model: ModelInfo, prompts: list[list[int]]
) -> int:
    name = (
        "max_completion_tokens"
        if kind == "chat" and "max_completion_tokens" in body
        else "max_tokens"
    )
    requested = _integer(body, name, None, low=1, high=None)
    longest = max(len(p) for p in prompts)
    context = model.context_length
    if requested is None:
        requested = model.defaults.max_tokens
        if context is not None:
            requested = min(requested, context - longest)
    if context is not None and longest + requested > context:
        raise ApiError(
            400,
            f"this model's maximum context length is {context} tokens; the request asks for "
            f"{longest + requested} ({longest} in the prompt, {requested} for the completion): "
            "shorten the prompt or lower max_tokens",
            param="messages" if kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    return requested


def _stop(value: Any, default: tuple[str, ...]) -> tuple[str, ...]:
    if value is None:
        return default
    stop = [value] if isinstance(value, str) else value
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise ApiError(
            400,
            f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them",
            param="stop",
        )
    return tuple(stop)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(
    body: dict[str, Any], name: str, default: Any, *, low: int | None, high: int | None
) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise ApiError(400, f"'{name}' must be an integer", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise ApiError(400, f"'{name}' must be {bounds}, got {value}", param=name)
    return value


def _number(body: dict[str, Any], name: str, default: float, *, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a number", param=name)
    if not low <= value <= high:
        raise ApiError(400, f"'{name}' must be from {low} to {high}, got {value}", param=name)
    return float(value)


def _boolean(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false", param=name)
    return value


# --- responses -------------------------------------------------------------------------------------

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
