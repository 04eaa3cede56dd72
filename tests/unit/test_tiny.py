"""The builtin tiny model specs: consistent with the config, and with transformers' own count."""

from __future__ import annotations

import pytest

from rollout.config.model import BUILTIN_MODELS
from rollout.models import builtin


def test_every_builtin_model_has_a_spec():
    assert set(builtin.TINY_MODELS) == set(BUILTIN_MODELS)


def test_configs_are_fresh_copies():
    config = builtin.hf_config("tiny-llama")
    config["hidden_size"] = 1
    assert builtin.hf_config("tiny-llama")["hidden_size"] == 64


def test_param_count_by_hand():
    # tiny-llama: embeddings 512*64; per layer q 64*64, k and v 64*32 each, o 64*64, MLP 3*64*128,
    # two norms of 64; a final norm of 64; the head is tied.
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert builtin.param_count(builtin.hf_config("tiny-llama")) == 512 * 64 + 2 * layer + 64
    # Qwen2 adds biases on q, k and v.
    assert builtin.param_count(builtin.hf_config("tiny-qwen2")) == 512 * 64 + 2 * (layer + 128) + 64


def test_param_count_untied_with_llama_biases():
    config = {**builtin.hf_config("tiny-llama"), "tie_word_embeddings": False}
    config.update(attention_bias=True, mlp_bias=True)
    tied = builtin.param_count(builtin.hf_config("tiny-llama"))
    biases = 2 * ((64 + 32 + 32 + 64) + (128 + 128 + 64))
    assert builtin.param_count(config) == tied + 512 * 64 + biases


def _exact_configs():
    mistral = {**builtin.hf_config("tiny-llama"), "architectures": ["MistralForCausalLM"]}
    biased = {**builtin.hf_config("tiny-llama"), "attention_bias": True, "mlp_bias": True}
    configs = {name: builtin.hf_config(name) for name in builtin.TINY_MODELS}
    configs.update({"mistral": {**mistral, "model_type": "mistral"}, "llama-biases": biased})
    for name, config in configs.items():
        yield pytest.param(config, id=name)
        yield pytest.param({**config, "tie_word_embeddings": False}, id=f"{name}-untied")


@pytest.mark.parametrize("config", list(_exact_configs()))
def test_param_count_matches_transformers(config):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):  # shapes only: nothing is allocated or initialized
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert type(model).__name__ == config["architectures"][0]
    assert {config["model_type"]} <= builtin.EXACT_PARAM_COUNT_TYPES
    assert sum(p.numel() for p in model.parameters()) == builtin.param_count(config)
