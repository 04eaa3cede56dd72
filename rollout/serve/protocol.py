"""OpenAI's request format, checked into engine terms (responses.py shapes the answers).

Every problem with a request becomes an ApiError: an HTTP status (4xx) and OpenAI's error shape,
{"error": {"message", "type", "param", "code"}}, where param names the offending field. Every
number is checked against the range the engine can take before anything reaches it (a seed
beyond 64 bits, a float where an integer belongs, an infinite temperature), and everything that
costs memory or time in proportion to the request is bounded before that cost is paid: prompts
and messages are counted before any is tokenized, and a text too long for the context (at
`ModelInfo.max_token_chars` characters a token at most) is refused without tokenizing it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from rollout.engines.base import SamplingParams
from rollout.redact import redact_text

MAX_N = 16
"""Most completions per prompt."""
MAX_PROMPTS = 64
"""Most prompts in one /v1/completions request."""
MAX_MESSAGES = 2048
"""Most messages in one chat request: a long agent episode fits; a body of a million tiny
messages is refused before the chat template renders them."""
MAX_STOP = 4
"""Most stop strings, as OpenAI allows."""
MAX_STOP_CHARS = 256
"""Longest stop string: the engine decodes 4 tokens a character of it after every token."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per token in chat (top_logprobs), as OpenAI allows."""
MAX_COMPLETION_LOGPROBS = 5
"""Most alternatives per token in completions (logprobs: N), as OpenAI allows."""
MAX_TOP_K = 2**31 - 1
"""top_k at or above the vocabulary size samples from all of it; beyond int32 it is an error."""
SEED_RANGE = (-(2**63), 2**63 - 1)
"""A 64-bit seed, as OpenAI's. torch takes [-2**63, 2**64), and prompt i of a list adds i."""
MIN_TEMPERATURE = 1e-5
"""The lowest temperature sampled at: a smaller positive one samples at this one, since logits /
T overflows to inf (and sampling to NaN) as T nears 0. 0 itself is greedy."""
MAX_TOKEN_CHARS = 32
"""Characters one token covers at most, when the tokenizer does not say (loading.py measures
the vocabulary): a text longer than context x this cannot fit, and is refused untokenized."""
MAX_TOKENS_WITHOUT_CONTEXT = 1 << 15
"""Most new tokens when the model does not say its context length (the KV cache grows with it)."""
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
        # Messages echo what the client sent (a path, a model name): never a credential back.
        message = redact_text(message)
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
    max_token_chars: int = MAX_TOKEN_CHARS
    """Characters one token of this tokenizer covers at most."""

    @property
    def max_prompt_chars(self) -> int | None:
        """Characters beyond which a text cannot fit the context, however it tokenizes."""
        if self.context_length is None:
            return None
        return self.context_length * self.max_token_chars


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
    sent: list[list[dict[str, str]]]
    """Per prompt, what the client sent as text: chat, its messages ({"role", "content"},
    checked); completions, [{"role": "prompt", "content": text}], or [] for token ids. An
    episode's record keeps it, for the run report (rollout.serve.recording)."""


def parse_request(kind: Kind, body: Any, model: ModelInfo) -> GenerationRequest:
    """Check a /v1/completions or /v1/chat/completions body against the served model: the
    cheap fields first, then the prompts (tokenized last)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_model(body.get("model"), model)
    n = _integer(body, "n", 1, low=1, high=MAX_N)
    temperature = _number(body, "temperature", model.defaults.temperature, low=0.0, high=2.0)
    if 0 < temperature < MIN_TEMPERATURE:
        temperature = MIN_TEMPERATURE
    top_p = _number(body, "top_p", model.defaults.top_p, low=0.0, high=1.0)
    if top_p == 0:
        raise ApiError(400, "'top_p' must be greater than 0", param="top_p")
    top_k = _integer(body, "top_k", model.defaults.top_k, low=0, high=MAX_TOP_K)
    stream = _boolean(body, "stream", False)
    include_usage = _include_usage(body.get("stream_options")) and stream
    logprobs, top_logprobs = _logprobs(kind, body)
    seed = _integer(body, "seed", None, low=SEED_RANGE[0], high=SEED_RANGE[1])
    stop = _stop(body.get("stop"), model.defaults.stop)
    if kind == "chat":
        messages = _chat_messages(body.get("messages"), model)
        prompts, sent = [_chat_prompt(messages, model)], [messages]
    else:
        prompts, texts = _completion_prompts(body.get("prompt"), model)
        sent = [[{"role": "prompt", "content": t}] for t in texts] if texts else [[]] * len(prompts)
    params = SamplingParams(
        max_new_tokens=_max_tokens(kind, body, model, prompts),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=stop,
        n=n,
        seed=seed,
        top_logprobs=top_logprobs,
    )
    return GenerationRequest(kind, prompts, params, stream, logprobs, include_usage, sent)


def per_prompt(request: GenerationRequest, index: int) -> SamplingParams:
    """The sampling parameters of prompt `index`: a seed gives each prompt its own stream."""
    params = request.params
    return params if params.seed is None else replace(params, seed=params.seed + index)


# --- fields ----------------------------------------------------------------------------------------


def _check_model(name: Any, model: ModelInfo) -> None:
    if not isinstance(name, str):
        raise ApiError(400, "'model' is required: a string naming the model", param="model")
    if name != model.name:
        raise ApiError(
            404,
            f"the model {_shown(name)} does not exist: this server serves {model.name!r}",
            param="model",
            code="model_not_found",
        )


def _logprobs(kind: Kind, body: dict[str, Any]) -> tuple[bool, int]:
    """(whether choices carry log-probs, alternatives per token)."""
    if kind == "chat":
        logprobs = _boolean(body, "logprobs", False)
        top_logprobs = _integer(body, "top_logprobs", 0, low=0, high=MAX_TOP_LOGPROBS)
        if top_logprobs and not logprobs:
            raise ApiError(
                400, "'top_logprobs' needs 'logprobs': true as well", param="top_logprobs"
            )
        return logprobs, top_logprobs
    requested = _integer(body, "logprobs", None, low=0, high=MAX_COMPLETION_LOGPROBS)
    return requested is not None, requested or 0


def _include_usage(options: Any) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    return _boolean(options, "include_usage", False, where="stream_options.")


def _completion_prompts(prompt: Any, model: ModelInfo) -> tuple[list[list[int]], list[str] | None]:
    """prompt: a string, a list of strings, a list of token ids, or a list of those lists, as
    token ids, and the texts when given as text. Counted and measured before any is tokenized."""
    if isinstance(prompt, str):
        texts: list[str] | None = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        texts = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        texts, prompts = None, [list(prompt)]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt)
    ):
        texts, prompts = None, [list(p) for p in prompt]
    else:
        raise ApiError(
            400,
            "'prompt' must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids",
            param="prompt",
        )
    if len(texts if texts is not None else prompts) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    if texts is not None:
        for text in texts:
            _check_text_fits(len(text), model, "prompt")
        prompts = [model.encode(text) for text in texts]
    for ids in prompts:
        if not ids:
            raise ApiError(400, "a prompt has no tokens", param="prompt")
        if any(not 0 <= t < model.vocab_size for t in ids):
            raise ApiError(400, f"token ids must lie in [0, {model.vocab_size})", param="prompt")
    return prompts, texts


def _chat_messages(messages: Any, model: ModelInfo) -> list[dict[str, str]]:
    if model.chat_encode is None:
        raise ApiError(
            400,
            "the model has no chat template: use /v1/completions, or serve it with a chat "
            "template (model.chat_template in the config)",
            param="messages",
        )
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(
            400,
            f"at most {MAX_MESSAGES} messages per request, got {len(messages)}",
            param="messages",
        )
    checked = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object", param=where)
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ApiError(
                400, f"{where}.role must be one of {sorted(CHAT_ROLES)}", param=f"{where}.role"
            )
        checked.append({"role": role, "content": _content(message.get("content"), where)})
    _check_text_fits(sum(len(m["content"]) for m in checked), model, "messages")
    return checked


def _chat_prompt(checked: list[dict[str, str]], model: ModelInfo) -> list[int]:
    assert model.chat_encode is not None  # _chat_messages refused the request otherwise
    try:
        ids = model.chat_encode(checked)
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


def _check_text_fits(chars: int, model: ModelInfo, param: str) -> None:
    """Refuse, untokenized, a text too long for the context however it tokenizes."""
    limit = model.max_prompt_chars
    if limit is not None and chars > limit:
        raise ApiError(
            400,
            f"this model's maximum context length is {model.context_length} tokens, and the "
            f"{param} is {chars} characters, more than that many tokens can hold (at most "
            f"{model.max_token_chars} characters each): shorten it",
            param=param,
            code="context_length_exceeded",
        )


def _max_tokens(
    kind: Kind, body: dict[str, Any], model: ModelInfo, prompts: list[list[int]]
) -> int:
    name = (
        "max_completion_tokens"
        if kind == "chat" and "max_completion_tokens" in body
        else "max_tokens"
    )
    context = model.context_length
    requested = _integer(body, name, None, low=1, high=context or MAX_TOKENS_WITHOUT_CONTEXT)
    if context is None:
        return requested if requested is not None else model.defaults.max_tokens
    longest = max(len(p) for p in prompts)
    where = "messages" if kind == "chat" else "prompt"
    if longest >= context:  # the encoder may have stopped counting at context + 1
        raise ApiError(
            400,
            f"this model's maximum context length is {context} tokens, and the {where} alone "
            "takes at least that many, leaving none for the completion: shorten it",
            param=where,
            code="context_length_exceeded",
        )
    if requested is None:
        requested = min(model.defaults.max_tokens, context - longest)
    if longest + requested > context:
        raise ApiError(
            400,
            f"this model's maximum context length is {context} tokens; the request asks for "
            f"{longest + requested} ({longest} in the prompt, {requested} for the completion): "
            "shorten the prompt or lower max_tokens",
            param=where,
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
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)
    ):
        raise ApiError(
            400,
            f"'stop' must be a string of 1 to {MAX_STOP_CHARS} characters or a list of at most "
            f"{MAX_STOP} of them",
            param="stop",
        )
    return tuple(stop)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(body: dict[str, Any], name: str, default: Any, *, low: int, high: int) -> Any:
    """An integer field within [low, high]; 2.0 or true is not one (JSON says what it means)."""
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise ApiError(400, f"'{name}' must be an integer, got {_shown(value)}", param=name)
    if not low <= value <= high:
        raise ApiError(
            400, f"'{name}' must be from {low} to {high}, got {_shown(value)}", param=name
        )
    return value


def _number(body: dict[str, Any], name: str, default: float, *, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    # An integer too big for a float compares exactly here; math.isfinite would overflow on it.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{name}' must be a number, got {_shown(value)}", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a finite number, got {value}", param=name)
    if not low <= value <= high:
        raise ApiError(
            400, f"'{name}' must be from {low} to {high}, got {_shown(value)}", param=name
        )
    return float(value)


def _boolean(body: dict[str, Any], name: str, default: bool, *, where: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(
            400, f"'{where}{name}' must be true or false, got {_shown(value)}", param=where + name
        )
    return value


def _shown(value: Any, limit: int = 60) -> str:
    """A value the client sent, short enough to echo in an error message (redacted before it is
    cut: a cut could leave a password without the '@' that marks it)."""
    text = repr(value) if not _is_int(value) or abs(value) < 10**limit else "a huge integer"
    text = redact_text(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."
