"""The builtin tiny random models, as pure data: their config.json and chat template.

`model.builtin = "tiny-llama"` (or "tiny-qwen2") plans and runs without a download: the planner
reads these specs, and the runtime builds the model with transformers from the same dicts. No torch
here, so planning a builtin model stays torch-free.
"""

from __future__ import annotations

from typing import Any

VOCAB_SIZE = 512
"""Vocabulary of the tiny models; the tiny tokenizer must produce exactly this many ids."""

# The special tokens take the first ids, in this order, as in SmolLM2's ChatML vocabulary.
ENDOFTEXT_ID = 0
IM_START_ID = 1
IM_END_ID = 2
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML: every turn is <|im_start|>ROLE\\nCONTENT<|im_end|>\\n."""

_ARCHITECTURES = {
    "tiny-llama": ("LlamaForCausalLM", "llama"),
    "tiny-qwen2": ("Qwen2ForCausalLM", "qwen2"),
}

_SHARED_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
    "bos_token_id": IM_START_ID,
    "eos_token_id": IM_END_ID,
    "pad_token_id": ENDOFTEXT_ID,
}

TINY_MODELS = tuple(_ARCHITECTURES)

EXACT_PARAM_COUNT_TYPES = frozenset({"llama", "mistral", "qwen2"})
"""model_types whose parameters `param_count` counts exactly; for others it is an estimate."""


def hf_config(name: str) -> dict[str, Any]:
    """A fresh config.json dict for the builtin model `name` (KeyError if there is none)."""
    architecture, model_type = _ARCHITECTURES[name]
    return {"architectures": [architecture], "model_type": model_type, **_SHARED_CONFIG}


def spec(name: str) -> dict[str, Any]:
    """Everything that defines the builtin model `name`; its canonical JSON is its fingerprint."""
    return {"name": name, "config": hf_config(name), "chat_template": CHAT_TEMPLATE}


def param_count(config: dict[str, Any]) -> int:
    """Parameters of a Llama/Mistral/Qwen2-style decoder, computed from its config.json dict.

    Exact for the model types in EXACT_PARAM_COUNT_TYPES. For other decoders it counts the same
    blocks and misses their extras (additional norms, MoE experts), so it is only an estimate.
    """
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    intermediate = config["intermediate_size"]
    vocab = config["vocab_size"]
    q_out, kv_out = heads * head_dim, kv_heads * head_dim

    # Llama's attention_bias puts biases on q, k, v and o; Qwen2 always has them on q, k, v only.
    attention_bias = bool(config.get("attention_bias", False))
    attention = hidden * (q_out + 2 * kv_out) + q_out * hidden
    if attention_bias or config.get("model_type") == "qwen2":
        attention += q_out + 2 * kv_out
    if attention_bias:
        attention += hidden
    mlp = 3 * hidden * intermediate
    if config.get("mlp_bias", False):
        mlp += 2 * intermediate + hidden
    layer = attention + mlp + 2 * hidden  # two RMSNorm weights per layer

    embeddings = vocab * hidden
    # transformers' Llama, Mistral and Qwen2 configs all default to untied embeddings.
    lm_head = 0 if config.get("tie_word_embeddings", False) else vocab * hidden
    return embeddings + config["num_hidden_layers"] * layer + hidden + lm_head
