"""[generation]: which engine samples completions, and how."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rollout.config.base import ConfigModel


class GenerationSection(ConfigModel):
    engine: Literal["hf", "vllm"] = Field(
        default="hf",
        description="Generation backend: 'hf' (embedded, runs anywhere) or 'vllm' (GPU only; "
        "install rollout[vllm]).",
    )
    max_new_tokens: int = Field(
        default=256, ge=1, description="Most tokens generated per completion."
    )
    max_prompt_tokens: int = Field(
        default=512,
        ge=1,
        description="Longest prompt in tokens; longer prompts are an error at plan time.",
    )
    temperature: float = Field(
        default=1.0, ge=0, description="Sampling temperature; 0 is greedy decoding."
    )
    top_p: float = Field(
        default=1.0, gt=0, le=1, description="Nucleus sampling mass; 1 disables it."
    )
    top_k: int = Field(
        default=0, ge=0, description="Sample among the k likeliest tokens; 0 disables."
    )
    stop: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description="Stop a completion when it produces any of these strings (kept out of the text).",
    )
    max_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="Most sequences the engine decodes at once (KV cache size). None: the whole "
        "rollout batch.",
    )
    cuda_graphs: Literal["auto"] | bool = Field(
        default="auto",
        description="Capture the decode step in CUDA graphs, one per batch-width bucket. 'auto': "
        "on a CUDA GPU the hf engine decodes Llama-family models (llama, mistral, qwen2) with "
        "its static step in CUDA graphs, and other models with their own forward; vllm keeps its "
        "own graphs. true: require them (refused on CPU, and for other models with the hf "
        "engine). false: hf runs its static step without graphs; vllm runs eagerly.",
    )
    gpu_memory_utilization: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="vLLM only (refused with the hf engine): share of GPU memory vLLM may take "
        "for weights and KV cache.",
    )
