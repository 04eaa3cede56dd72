"""What a model is, read from its config.json or GGUF metadata without loading weights: the planner
finds these facts and freezes them in the plan; loading, memory estimates and inference read them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ModelFacts(BaseModel):
    """What the model is, read from config.json or GGUF metadata without loading weights."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Literal["path", "package", "builtin", "hub"]
    location: str = Field(
        description="Absolute path or URL of the model; 'builtin:NAME' for builtins; for a Hub "
        "model, its snapshot directory in the Hugging Face cache."
    )
    commit: str | None = Field(
        default=None,
        description="For a Hub model, the commit sha its revision resolved to at plan time.",
    )
    format: Literal["hf", "gguf", "builtin"]
    fingerprint: str = Field(
        description="sha256 of the model's metadata (config.json or GGUF header)."
    )
    architecture: str
    model_type: str
    num_parameters: int
    vocab_size: int
    context_length: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    chat_template: bool = Field(
        description="Whether a chat template is available (model or override)."
    )
    quantization: str | None = Field(default=None, description="GGUF file type, e.g. 'Q4_1'.")
    file_bytes: int | None = Field(
        default=None, description="Size of the weights on disk, if known."
    )
