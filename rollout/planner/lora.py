"""[model.lora] against the model: which linear layers exist, and how many parameters the adapters
add (the only ones a LoRA run trains).

Read from the model's facts, without torch and without the weights: rollout trains Llama-family
decoders, whose every layer has the same seven projections, so their names and shapes follow from
the architecture (hidden size, heads, key/value heads, head size, MLP width). peft's
"all-linear" takes them all and leaves the vocabulary head alone, as the runtime does.
"""

from __future__ import annotations

from rollout.config.model import ALL_LINEAR, LoraSection
from rollout.errors import Issue, did_you_mean
from rollout.models.facts import ModelFacts

LORA_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""model_types whose decoder layers hold exactly the projections of `decoder_linears`."""


def decoder_linears(model: ModelFacts) -> dict[str, tuple[int, int]]:
    """Each linear layer of one decoder layer: name -> (in_features, out_features)."""
    hidden, intermediate = model.hidden_size, model.intermediate_size
    attention = model.num_attention_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    return {
        "q_proj": (hidden, attention),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (attention, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


def target_names(lora: LoraSection, model: ModelFacts) -> list[str]:
    """The module names that get adapters (every projection for "all-linear")."""
    if lora.target_modules == ALL_LINEAR:
        return list(decoder_linears(model))
    return list(lora.target_modules)


def adapter_parameters(lora: LoraSection, model: ModelFacts) -> int:
    """Parameters of every adapter: rank x (in + out) per adapted layer (A is [r, in], B
    [out, r]), for each decoder layer."""
    shapes = decoder_linears(model)
    per_layer = sum(lora.rank * sum(shapes[name]) for name in target_names(lora, model))
    return model.num_layers * per_layer


def lora_issues(lora: LoraSection | None, model: ModelFacts) -> list[Issue]:
    """Why [model.lora] cannot adapt this model: an architecture whose layers are not known, or
    target module names that no decoder layer has (with the nearest name)."""
    if lora is None:
        return []
    if model.model_type not in LORA_MODEL_TYPES:
        return [
            Issue(
                "model.lora",
                f"LoRA adapts Llama-family decoders ({', '.join(sorted(LORA_MODEL_TYPES))}); "
                f"this model is a {model.model_type!r} ({model.architecture})",
                hint="remove [model.lora] to train every weight, or use a Llama-family model",
            )
        ]
    if lora.target_modules == ALL_LINEAR:
        return []
    known = list(decoder_linears(model))
    issues = []
    for i, name in enumerate(lora.target_modules):
        if name in known:
            continue
        head = " (the vocabulary head is not adapted)" if name == "lm_head" else ""
        issues.append(
            Issue(
                f"model.lora.target_modules[{i}]",
                f"{model.architecture}'s decoder layers have no linear layer {name!r}{head}; "
                f"they have {', '.join(known)}",
                value=name,
                hint=did_you_mean(name, known)
                or f"use some of {', '.join(known)}, or {ALL_LINEAR!r}",
            )
        )
    return issues
