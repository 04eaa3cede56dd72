"""Log-probs (and entropies) of given tokens under a causal LM: the learner's, the reference's and
the offline objectives' one way of scoring tokens.

Two routes, chosen per model:

- the chunked head (rollout.algorithms.chunked_head): the transformer trunk runs to its final
  hidden states, and the vocabulary projection and log-softmax run in chunks of tokens, only at
  the positions that are scored, so the [B, T, V] logits never exist;
- the full logits, for a model whose logits are more than a linear projection of the last hidden
  state (Gemma 2's final soft-capping, Cohere's logit scale, Granite's logits scaling, or an
  architecture not known here): the model's own forward, then token_logprobs.

Callers run `final_states` (hidden states or logits, whichever the route needs) and hand them to
`token_scores`; neither knows which route ran.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.algorithms.chunked_head import head_logprobs
from rollout.algorithms.losses import entropy_from_logits, token_logprobs
from rollout.engines.base import cache_keyword
from rollout.runtime.sharding import is_sharded

CHUNKED_HEAD_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "phi3", "olmo", "olmo2", "smollm3", "gemma"}
)
"""Architectures whose causal-LM forward computes logits as exactly lm_head(final hidden state);
the planner's memory estimate keeps a copy of this set (rollout.planner.memory)."""

LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config attributes with which transformers changes the logits after the head: a model that sets
one (to other than 1) takes the full-logits route."""


def chunked_head(model: Any) -> torch.nn.Linear | None:
    """The vocabulary projection when the chunked head applies to `model`, else None."""
    inner = _unwrapped(model)
    if is_sharded(inner):
        # FSDP gathers a layer's weights only around its module's forward: the head's weight
        # read as a tensor, or the trunk run without the root, would be a shard.
        return None
    config = getattr(inner, "config", None)
    if getattr(config, "model_type", None) not in CHUNKED_HEAD_MODEL_TYPES:
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_POSTPROCESSING):
        return None
    output_embeddings = getattr(inner, "get_output_embeddings", None)
    if output_embeddings is None:
        # A wrapper that only forwards (LoRA's reference, rollout.models.lora.WithoutAdapters,
        # turns the adapters off around its forward): its trunk must not be run around it.
        return None
    head = output_embeddings()
    # A plain Linear only: a LoRA-wrapped head adds its own terms to the projection.
    if type(head) is not torch.nn.Linear or _trunk(inner) is None:
        return None
    return head


def final_states(model: Any, *, keep: int, **inputs: Any) -> torch.Tensor:
    """The last `keep` positions of `model`'s forward on `inputs`: final hidden states [B, keep, H]
    for the chunked head, else logits [B, keep, V]. A `cache` input is passed by whichever
    keyword the module called takes it."""
    cache = inputs.pop("cache", None)
    if chunked_head(model) is None:
        extra = {} if cache is None else {cache_keyword(model): cache}
        return model(**inputs, **extra, logits_to_keep=keep).logits
    trunk = _trunk(_unwrapped(model))
    extra = {} if cache is None else {cache_keyword(trunk): cache}
    return trunk(**inputs, **extra).last_hidden_state[:, -keep:]


def token_scores(
    model: Any,
    states: torch.Tensor,
    tokens: torch.Tensor,
    rows: torch.Tensor,
    *,
    temperature: float,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature) at `tokens`, and with `entropy` the entropy of that
    distribution (no gradient), from `final_states`' answer.

    states: [B, T, H] or [B, T, V]; tokens: [B, T] int64; rows: [N] int64 indices into the
    flattened [B * T] positions that are scored, on the CPU (host data, e.g.
    ``mask.flatten().nonzero()`` of the padding code's CPU mask: reading it never waits for the
    device). Returns [B, T]
    float32 tensors: values at the scored positions (elsewhere 0 from the chunked head,
    whatever the logits give from the full ones: mask them).
    """
    head = chunked_head(model)
    if head is None:
        logprobs = token_logprobs(states, tokens, temperature)
        if not entropy:
            return logprobs, None
        with torch.no_grad():
            return logprobs, entropy_from_logits(states.detach(), temperature)
    batch, width = tokens.shape
    device = states.device
    logprobs, entropies = head_logprobs(
        states.reshape(batch * width, -1),
        head.weight,
        head.bias,
        tokens.reshape(-1),
        rows.to(device, non_blocking=True),
        temperature=temperature,
        compute_dtype=_compute_dtype(device, head.weight.dtype),
        entropy=entropy,
    )
    return logprobs.view(batch, width), (
        None if entropies is None else entropies.view(batch, width)
    )


def _compute_dtype(device: torch.device, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the model's own head would run in: autocast's, when it is on."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return weight_dtype


def _unwrapped(model: Any) -> Any:
    """A peft model's transformers model (its LoRA layers sit inside it, so running it runs
    them); any other model as it is."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def _trunk(model: Any) -> Any:
    """The transformer under the vocabulary head (transformers' base_model), or None."""
    trunk = getattr(model, "base_model", None)
    return None if trunk is None or trunk is model else trunk
