"""The planned model's tokenizer and chat template, without torch or transformers.

The planner counts tokens to check data.max_length. It loads the model's tokenizer.json with the
`tokenizers` library and renders the chat template with jinja2 the way transformers does (same
environment options, the special tokens as variables), then encodes the text without adding
special tokens, as transformers' apply_chat_template does. A test checks the counts agree with the
worker's transformers tokenizer.

A GGUF file's tokenizer is converted by transformers when a worker first loads the model, into
rollout's cache of the dequantized model (rollout.models.loading.dense_gguf_dir). The planner
reads the tokenizer from there once it exists, or from model.tokenizer when that is set (the
worker then uses it too). Where no tokenizer.json can be read without transformers (a GGUF file
before its first run, a remote model, a sentencepiece-only tokenizer), `load` returns None and the
lengths are not checked at plan time.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from rollout.config.model import ModelSection
from rollout.files import is_url
from rollout.models.cache import cache_root
from rollout.models.facts import ModelFacts
from rollout.models.gguf import read_gguf_header
from rollout.planner import locations

_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class PlanTokenizer:
    """encode / chat / eos_token_id, as rollout.models.samples.TextTokenizer asks."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None,
        special_tokens: dict[str, str],
        eos_token_id: int,
    ):
        self._tokenizer = tokenizer
        self._special_tokens = special_tokens
        self._template = _compile(chat_template) if chat_template else None
        self.eos_token_id = eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> list[int]:
        if self._template is None:
            raise ValueError("the model has no chat template")
        text = self._template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self._special_tokens,
        )
        return self.encode(text, add_special_tokens=False)


def load(facts: ModelFacts, section: ModelSection, *, base_dir: Path) -> PlanTokenizer | None:
    """The tokenizer the worker will use, or None where it cannot be read without transformers."""
    override = _chat_template_override(section, base_dir)
    if facts.format == "builtin" and section.tokenizer is None:
        return _builtin(facts.location.removeprefix("builtin:"), override)
    if facts.format == "gguf":
        return _gguf(facts, section, override, base_dir)
    if is_url(facts.location):
        return None
    if section.tokenizer is None:
        directory = facts.location
    else:
        directory = locations.resolve(section.tokenizer, base_dir)
    return _from_directory(directory, override, model_eos=_model_eos(facts))


def dense_gguf_directory(fingerprint: str) -> Path:
    """Where a worker keeps the GGUF file of this fingerprint dequantized, with its tokenizer
    converted by transformers (rollout.models.loading.dense_gguf_dir builds it)."""
    return cache_root() / "gguf" / fingerprint[:16]


def _gguf(
    facts: ModelFacts, section: ModelSection, override: str | None, base_dir: Path
) -> PlanTokenizer | None:
    """The worker's tokenizer for a GGUF model, where it can be read without transformers."""
    dense = dense_gguf_directory(facts.fingerprint)
    if section.tokenizer is not None:
        directory = locations.resolve(section.tokenizer, base_dir)
    elif dense.is_dir():
        directory = str(dense)
    else:
        return None
    # The worker's end-of-turn token: its dense copy's configs, which transformers fills from
    # the GGUF's tokenizer.ggml.eos_token_id, the key read here before the copy exists.
    eos = _configured_eos(dense) if dense.is_dir() else _gguf_eos(facts.location)
    return _from_directory(directory, override, model_eos=eos)


def _gguf_eos(location: str) -> int | None:
    try:
        value = read_gguf_header(location).metadata.get("tokenizer.ggml.eos_token_id")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _builtin(name: str, override: str | None) -> PlanTokenizer:
    from rollout.models import builtin
    from rollout.models.builtin_build import tiny_tokenizer

    endoftext, im_start, im_end = builtin.SPECIAL_TOKENS
    return PlanTokenizer(
        tiny_tokenizer(),
        chat_template=override or builtin.CHAT_TEMPLATE,
        special_tokens={"bos_token": im_start, "eos_token": im_end, "pad_token": endoftext},
        eos_token_id=builtin.hf_config(name)["eos_token_id"],
    )


class NoEndOfSequence(ValueError):
    """Neither the model's config nor its tokenizer names an end-of-sequence token: the worker
    would refuse the model (rollout.models.loading), so the plan does."""


def _from_directory(
    directory: str, override: str | None, *, model_eos: int | None
) -> PlanTokenizer | None:
    files = Path(directory.removeprefix("file://"))
    if is_url(directory) or not (files / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(files / "tokenizer.json"))
    except Exception:  # tokenizers raises its own error types; the worker's load reports it
        return None
    config = _json(files / "tokenizer_config.json")
    special = {name: _content(config.get(name)) for name in _SPECIAL_TOKENS}
    special = {name: value for name, value in special.items() if value is not None}
    eos = model_eos
    if eos is None and "eos_token" in special:
        eos = tokenizer.token_to_id(special["eos_token"])
    if eos is None:
        raise NoEndOfSequence(directory)
    return PlanTokenizer(
        tokenizer,
        chat_template=override or _own_template(files, config),
        special_tokens=special,
        eos_token_id=eos,
    )


def _own_template(directory: Path, config: dict[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


def _chat_template_override(section: ModelSection, base_dir: Path) -> str | None:
    template = section.chat_template
    if template is None or not template.endswith(".jinja"):
        return template
    path = Path(locations.resolve(template, base_dir).removeprefix("file://"))
    return path.read_text(encoding="utf-8") if path.is_file() else None


def _model_eos(facts: ModelFacts) -> int | None:
    """The first end-of-sequence id the worker finds (rollout.models.loading looks in the
    generation config, then the model config, then the tokenizer)."""
    if facts.format == "builtin":
        from rollout.models import builtin

        return builtin.hf_config(facts.location.removeprefix("builtin:"))["eos_token_id"]
    return _configured_eos(Path(facts.location.removeprefix("file://")))


def _configured_eos(directory: Path) -> int | None:
    """The end-of-sequence id of a model directory's generation config, else its config."""
    for name in ("generation_config.json", "config.json"):
        value = _json(directory / name).get("eos_token_id")
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _compile(template: str) -> Any:
    """The template in the environment transformers renders chat templates in."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, **kwargs: Any) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(template)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)
