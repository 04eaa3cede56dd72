"""Load the planned model and its tokenizer inside a worker.

The plan's ModelFacts say where the model is and in which format; the [model] section says which
tokenizer and chat template override it. Everything comes from local files: builtin tiny models are
built into a cache (rollout.models.builtin_build), Hugging Face directories load from safetensors
only, and GGUF files are dequantized by transformers into a dense, trainable model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
from transformers.utils import logging as transformers_logging

from rollout.config.model import ModelSection
from rollout.models.cache import built_once
from rollout.models.facts import ModelFacts


@dataclass
class LoadedModel:
    model: Any
    """The transformers causal LM, on the requested device and dtype; its train/eval mode is
    transformers' default (eval) and left to the caller."""
    tokenizer: Any
    chat_template: str | None
    """The template in force (override or the tokenizer's own); also set on the tokenizer."""
    eos_token_ids: list[int]
    pad_token_id: int


def load_model(
    facts: ModelFacts,
    section: ModelSection,
    *,
    dtype: str,
    device: str,
    base_dir: Path | None = None,
) -> LoadedModel:
    """Load the model the plan describes. `dtype` is a torch dtype name ("float32", "bfloat16").

    `base_dir` resolves relative model.tokenizer and model.chat_template paths (the plan's
    base_dir); None means the working directory.
    """
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    # rollout draws its own progress (a run's bar, generate's); transformers' loading bar would
    # tear it, and clutters every test that loads a model.
    transformers_logging.disable_progress_bar()
    directory, model_kwargs = _weights_source(facts)
    model_kwargs.update(dtype=getattr(torch, dtype), trust_remote_code=section.trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(directory, **model_kwargs)
    model.to(device)

    tokenizer = _load_tokenizer(section, base, directory)

    chat_template = _chat_template(section.chat_template, base) or tokenizer.chat_template
    tokenizer.chat_template = chat_template
    eos_token_ids = _eos_token_ids(model, tokenizer)
    if tokenizer.pad_token_id is None:
        # Padding is masked out everywhere, so any real token will do; eos is the usual choice.
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(eos_token_ids[0])
    return LoadedModel(model, tokenizer, chat_template, eos_token_ids, tokenizer.pad_token_id)


def apply_chat_template(
    tokenizer: Any, chat_template: str | None, prompt: str, system_prompt: str | None
) -> list[int]:
    """Token ids of a one-turn conversation, ending with the generation prompt (the assistant's
    turn opened, ready for the model to answer)."""
    if chat_template is None:
        raise ValueError(
            "the model has no chat template: set model.chat_template to a Jinja template or a "
            ".jinja file"
        )
    messages = [{"role": "user", "content": prompt}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return list(
        tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )


def _weights_source(facts: ModelFacts) -> tuple[str, dict[str, Any]]:
    """The directory to call from_pretrained on, and the keyword arguments that pick the weights."""
    if facts.format == "builtin":
        from rollout.models.builtin_build import builtin_model_dir

        return str(builtin_model_dir(facts.location.removeprefix("builtin:"))), {
            "use_safetensors": True
        }
    if "://" in facts.location and not facts.location.startswith("file://"):
        raise ValueError(
            f"cannot load {facts.location}: remote models are not loaded yet; copy it to a local "
            "directory and point model.path at that"
        )
    location = facts.location.removeprefix("file://")
    if facts.format == "hf":
        # Never unpickle a .bin checkpoint: safetensors cannot run code.
        return location, {"use_safetensors": True}
    return str(dense_gguf_dir(location, facts.fingerprint)), {"use_safetensors": True}


def dense_gguf_dir(location: str, fingerprint: str) -> Path:
    """A Hugging Face directory holding the GGUF file's weights dequantized, built once per file.

    transformers takes about half a minute to parse and dequantize a GGUF file (it reads the
    metadata three times); every worker of every run would pay it. The dense copy loads in about
    a second. It is keyed by the plan's fingerprint of the file, so a changed file builds anew.
    """

    def build(directory: Path) -> None:
        source = {
            "pretrained_model_name_or_path": os.path.dirname(location),
            "gguf_file": os.path.basename(location),
        }
        # dequantize=True asks for a dense model even where a GGUF matmul kernel is installed
        # (which would keep the weights packed, and untrainable).
        model = AutoModelForCausalLM.from_pretrained(
            **source, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
        )
        model.save_pretrained(directory)
        AutoTokenizer.from_pretrained(**source).save_pretrained(directory)

    return built_once(f"gguf/{fingerprint[:16]}", build)


def _load_tokenizer(section: ModelSection, base: Path, directory: str) -> Any:
    """The override tokenizer if there is one, else the model's own."""
    source = directory if section.tokenizer is None else str(_resolve(section.tokenizer, base))
    return AutoTokenizer.from_pretrained(source, trust_remote_code=section.trust_remote_code)


def _chat_template(override: str | None, base: Path) -> str | None:
    if override is None or not override.endswith(".jinja"):
        return override
    return _resolve(override, base).read_text(encoding="utf-8")


def _resolve(location: str, base: Path) -> Path:
    path = Path(location.removeprefix("file://")).expanduser()
    return path if path.is_absolute() else base / path


def _eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a turn: the generation config's (chat models often list several), the
    model config's and the tokenizer's, in that order, without repeats."""
    ids: list[int] = []
    generation_config = getattr(model, "generation_config", None)
    for source in (
        getattr(generation_config, "eos_token_id", None),
        model.config.eos_token_id,
        tokenizer.eos_token_id,
    ):
        for token_id in source if isinstance(source, list) else [source]:
            if token_id is not None and token_id not in ids:
                ids.append(token_id)
    if not ids:
        raise ValueError("the model and its tokenizer define no end-of-sequence token")
    return ids
