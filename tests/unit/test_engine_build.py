"""build_engine: the one constructor of engines, by name, from explicit arguments."""

from __future__ import annotations

import pytest

from rollout.engines import vllm
from rollout.engines.base import SamplingParams
from rollout.engines.build import build_engine
from rollout.engines.hf.engine import HfEngine


def _tokens(tiny_llama, **options):
    return dict(
        tokenizer=tiny_llama.tokenizer,
        eos_token_ids=tiny_llama.eos_token_ids,
        pad_token_id=tiny_llama.pad_token_id,
        device="cpu",
        **options,
    )


def test_hf_samples_with_the_model_in_place_as_a_direct_engine_does(tiny_llama):
    built = build_engine(
        "hf", model=tiny_llama.model, **_tokens(tiny_llama, max_batch_size=2, seed=5)
    )
    direct = HfEngine(tiny_llama.model, **_tokens(tiny_llama, max_batch_size=2, seed=5))
    assert isinstance(built, HfEngine)
    assert built.model is tiny_llama.model and built.max_batch_size == 2
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2)
    prompts = [[1, 20, 30], [1, 40]]
    assert [c.token_ids for c in built.generate(prompts, params)] == [
        c.token_ids for c in direct.generate(prompts, params)
    ]


def test_vllm_gets_its_directory_tokenizer_and_limits(monkeypatch, tiny_llama, tmp_path):
    """Without vllm installed: the arguments VllmEngine would get."""
    seen = {}

    def fake(model, **kwargs):
        seen.update(model=model, **kwargs)
        return "engine"

    monkeypatch.setattr(vllm, "VllmEngine", fake)
    engine = build_engine(
        "vllm",
        model=None,
        **_tokens(tiny_llama, max_batch_size=8, seed=3),
        model_dir=tmp_path,
        tokenizer_dir="tok",
        dtype="bfloat16",
        gpu_memory_utilization=0.7,
        max_model_len=512,
    )
    assert engine == "engine"
    assert seen == {
        "model": str(tmp_path),
        "eos_token_ids": tiny_llama.eos_token_ids,
        "tokenizer": "tok",
        "dtype": "bfloat16",
        "seed": 3,
        "gpu_memory_utilization": 0.7,
        "max_model_len": 512,
        "max_num_seqs": 8,
        "enforce_eager": False,  # cuda_graphs unset (auto): vLLM keeps its own graphs
    }
    build_engine(
        "vllm",
        model=None,
        **_tokens(tiny_llama, max_batch_size=8),
        model_dir=tmp_path,
        cuda_graphs=False,
    )
    assert seen["enforce_eager"] is True


def test_vllm_needs_a_directory_and_unknown_engines_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="pass model_dir"):
        build_engine("vllm", model=None, **_tokens(tiny_llama, max_batch_size=None))
    with pytest.raises(ValueError, match="engine 'sglang' is no built-in \\(hf, vllm\\)"):
        build_engine("sglang", model=None, **_tokens(tiny_llama, max_batch_size=None))
