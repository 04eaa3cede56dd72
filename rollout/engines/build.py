"""The one place a generation engine is constructed, by name, from explicit arguments.

The trainer, `rollout generate` and `rollout serve` each call build_engine; what differs between
them (the seed, the batch size, whether packed weights are kept, where vLLM's model directory
comes from) is in the arguments they pass. An engine's module is imported only when it is chosen,
so importing this one costs neither torch nor vllm.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout.engines.base import Engine

ENGINES = ("hf", "vllm")


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
) -> Engine:
    """The engine `kind` ("hf" or "vllm") over a loaded model and its tokenizer.

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
    raise ValueError(f"unknown engine {kind!r}: one of {', '.join(ENGINES)}")
