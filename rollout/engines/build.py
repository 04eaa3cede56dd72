"""The one place a generation engine is constructed, by name or plugin, from explicit arguments.

The trainer, `rollout generate`, `rollout eval` and `rollout serve` each call build_engine; what
differs between them (the seed, the batch size, whether packed weights are kept, where vLLM's
model directory comes from) is in the arguments they pass. An engine's module is imported only
when it is chosen, so importing this one costs neither torch nor vllm. An engine plugin (any
other `kind`: its reference) is built by its factory from an EngineSpec of the same arguments,
and what it returns is checked against the Engine Protocol (rollout.engines.plugin).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout.engines.base import Engine

if TYPE_CHECKING:
    from rollout.engines.plugin import EnginePlugin

ENGINES = ("hf", "vllm")
"""The built-in engines (rollout.config.generation.BUILTIN_ENGINES names the same)."""


def build_engine(
    kind: str,
    *,
    model: Any,
    tokenizer: Any,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    device: str,
    max_batch_size: int | None,
    seed: int | None = None,
    keep_packed: bool = False,
    model_dir: str | Path | None = None,
    tokenizer_dir: str | None = None,
    dtype: str = "auto",
    gpu_memory_utilization: float = 0.5,
    max_model_len: int | None = None,
    cuda_graphs: bool | None = None,
    max_context: int | None = None,
    plugin: EnginePlugin | None = None,
) -> Engine:
    """The engine `kind` ("hf", "vllm", or an engine plugin's reference) over a loaded model and
    its tokenizer. For a plugin, `plugin` holds its factory, loaded by the caller from what the
    reference resolved to: it is called with an EngineSpec of these arguments.

    hf samples with `model` itself, in place (it may be the learner's module), on `device`;
    `keep_packed` keeps its packed weights between calls (see HfEngine). vllm loads a copy of its
    own from `model_dir`, a Hugging Face directory, with the tokenizer in `tokenizer_dir` (None:
    the model directory's), in `dtype`, and ignores `model`; `max_batch_size` is its
    max_num_seqs. `seed` seeds the engine's own stream, used where a call brings no seed of its
    own (None: a random stream).

    `cuda_graphs` (None: auto): hf captures its static decode step in CUDA graphs (see HfEngine);
    vllm runs eagerly when it is False. `max_context` sizes hf's static cache up front (prompt
    plus completion tokens, when known: a run's), so that it never grows and recaptures.
    """
    if kind == "hf":
        from rollout.engines.hf.engine import HfEngine

        return HfEngine(
            model,
            eos_token_ids=eos_token_ids,
            pad_token_id=pad_token_id,
            tokenizer=tokenizer,
            max_batch_size=max_batch_size,
            device=device,
            seed=seed,
            keep_packed=keep_packed,
            cuda_graphs=cuda_graphs,
            max_context=max_context,
        )
    if kind == "vllm":
        if model_dir is None:
            raise ValueError("the vllm engine loads a model directory of its own: pass model_dir")
        from rollout.engines.vllm import VllmEngine

        return VllmEngine(
            str(model_dir),
            eos_token_ids=eos_token_ids,
            tokenizer=tokenizer_dir,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_seqs=max_batch_size,
            enforce_eager=cuda_graphs is False,
        )
    if plugin is None:
        raise ValueError(f"engine {kind!r} is no built-in ({', '.join(ENGINES)}): pass plugin")
    from rollout.engines.plugin import EngineSpec, checked_engine

    spec = EngineSpec(
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=tuple(eos_token_ids),
        pad_token_id=pad_token_id,
        device=device,
        max_batch_size=max_batch_size,
        seed=seed,
        model_dir=Path(model_dir) if model_dir is not None else None,
        dtype=dtype,
        max_context=max_context,
        cuda_graphs=cuda_graphs,
        keep_packed=keep_packed,
    )
    return checked_engine(plugin.factory(spec), plugin)
