"""[generation]: which engine samples completions, and how."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

from rollout.config.base import ConfigModel
from rollout.config.rewards import check_plugin_ref

BUILTIN_ENGINES: tuple[str, ...] = ("hf", "vllm")


def check_engine(value: str) -> str:
    """A built-in engine's name, or an engine plugin's reference (resolved at plan). A bare name
    close to a built-in's is taken for a typo of it, not for an entry point's name."""
    if value in BUILTIN_ENGINES:
        return value
    check_plugin_ref(value)
    if ":" not in value:
        from rollout.config.translate import did_you_mean_choice

        if did_you_mean_choice(value, list(BUILTIN_ENGINES)) is not None:
            # As a choice outside a Literal is reported: "expected one of", with the hint.
            raise PydanticCustomError(
                "literal_error",
                "Input should be {expected}",
                {"expected": " or ".join(repr(name) for name in BUILTIN_ENGINES)},
            )
    return value


def is_plugin_engine(engine: str) -> bool:
    """A plugin reference rather than a built-in engine's name."""
    return engine not in BUILTIN_ENGINES


EngineRef = Annotated[
    str,
    AfterValidator(check_engine),
    Field(examples=[*BUILTIN_ENGINES, "my_pkg.engines:make", "./engine.py:make"]),
]


class GenerationSection(ConfigModel):
    engine: EngineRef = Field(
        default="hf",
        description="Generation backend: 'hf' (embedded, runs anywhere), 'vllm' (GPU only; "
        "install rollout[vllm]), or an engine plugin: 'package.module:make', './file.py:make' "
        "(relative to the config) or an entry point in the 'rollout.engines' group, called as "
        "make(spec) for an object with the Engine methods (generate, load_weights, "
        "policy_version, stats, close). A plugin engine gets the hf engine's defaults; "
        "vllm-only keys are refused with it. See docs/plugins.md.",
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
