"""LoRA adapters on a loaded policy, through peft ([model.lora]).

`add_adapters` wraps the model with peft's `get_peft_model`: peft replaces the targeted linear
layers in place (the transformers model stays the module everyone calls: learner, engine,
critic) and freezes every base weight, so an optimizer over the trainable parameters trains the
adapters alone. The returned `Adapters` is what only LoRA needs on top:

- `without_adapters()`: the reference model, the same module run under peft's
  `disable_adapter()`: the base model, with no second copy of it;
- `save` / `load`: the adapter's weights (peft's own safetensors layout, loadable with
  `PeftModel.from_pretrained(base, directory)`), and `save_merged`: a plain Hugging Face model
  directory with the adapters merged in, written from merged copies of the adapted weights so
  that the live base weights are never touched (merging and unmerging in place would round them a
  little more at every checkpoint).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rollout.config.model import LoraSection

ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""The file peft's save_pretrained writes an adapter's weights to."""


@dataclass
class Adapters:
    """The LoRA adapters peft added to `model` (the transformers model, adapted in place)."""

    peft_model: Any
    """peft's PeftModelForCausalLM around `model`: what saves, loads and switches adapters."""
    export_merged: bool = False
    """model.lora.export = "merged": checkpoints hold the merged model beside the adapter."""

    @property
    def model(self) -> Any:
        return self.peft_model.get_base_model()

    def parameters(self) -> list[torch.nn.Parameter]:
        """The adapters' parameters: every trainable parameter of the adapted model."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def without_adapters(self) -> WithoutAdapters:
        return WithoutAdapters(self.peft_model)

    def save(self, directory: Path) -> None:
        """adapter_config.json and adapter_model.safetensors (peft's layout) into `directory`."""
        self.peft_model.save_pretrained(directory, safe_serialization=True)

    def load(self, directory: Path) -> None:
        """The adapter weights `save` wrote, in place; every adapter tensor must be there."""
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        saved = load_file(directory / ADAPTER_WEIGHTS)
        expected = set(get_peft_model_state_dict(self.peft_model))
        if set(saved) != expected:
            missing, unexpected = sorted(expected - set(saved)), sorted(set(saved) - expected)
            raise ValueError(
                f"the adapter in {directory} does not match [model.lora]: missing "
                f"{missing or 'none'}, unexpected {unexpected or 'none'}"
            )
        set_peft_model_state_dict(self.peft_model, saved)

    def save_merged(self, directory: Path) -> None:
        """The adapted model as a plain transformers model directory: each adapted weight W
        saved as W + its adapters' delta, under the name the unadapted model gives it."""
        self.model.save_pretrained(directory, state_dict=merged_state_dict(self.model))


def add_adapters(model: Any, lora: LoraSection) -> Adapters:
    """Wrap `model` with LoRA adapters as [model.lora] says (B starts at zero: the adapted model
    computes exactly what the base does until the first update)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # peft 0.21 reads transformers' deprecated is_gradient_checkpointing: a FutureWarning
        # about peft's code in every run's log, which nobody running rollout can act on.
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
        )
        return Adapters(get_peft_model(model, config), export_merged=lora.export == "merged")


class WithoutAdapters(torch.nn.Module):
    """The adapted policy with its adapters off: called like the transformers model (same
    keywords, same config), it computes the base model's outputs. The reference of LoRA runs.

    A module without parameters of its own: the policy's are not registered here, so nothing
    that walks this module's parameters (an optimizer, a gradient average) sees them twice. It
    runs the policy in eval mode, as a frozen reference copy would be: the policy may be in
    train mode when the learner asks (dropout would perturb the reference, and gradient
    checkpointing would turn off the KV cache the shared-prefix forward relies on).

    Only its forward turns the adapters off, so it offers no head or trunk to run apart: the
    learner scores it through full logits (rollout.runtime.logprobs.chunked_head), without a
    gradient, so without the copy a backward would keep."""

    def __init__(self, peft_model: Any) -> None:
        super().__init__()
        # Not registered as submodules: see above.
        object.__setattr__(self, "_peft_model", peft_model)
        object.__setattr__(self, "_policy", peft_model.get_base_model())
        self.config = self._policy.config

        def forward(*args: Any, **kwargs: Any) -> Any:
            with self._base():
                return self._policy(*args, **kwargs)

        # The model's own signature, so that callers that inspect it (which keyword takes the
        # KV cache: rollout.engines.base.cache_keyword) find what the model takes.
        self.forward = functools.update_wrapper(forward, self._policy.forward)

    @contextmanager
    def _base(self) -> Iterator[None]:
        was_training = self._policy.training
        self._policy.eval()
        try:
            with self._peft_model.disable_adapter():
                yield
        finally:
            self._policy.train(was_training)


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict as the unadapted model names it, each adapted layer's weight merged
    (W + its active adapters' deltas, new tensors: `model` is left as it is)."""
    adapted = dict(lora_layers(model))
    merged: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        if ".lora_" in key:
            continue  # the adapters themselves: merged into their layer's weight below
        merged[key.replace(".base_layer.", ".")] = tensor
    for name, layer in adapted.items():
        weight = layer.base_layer.weight.detach()
        # Summed in float32 and rounded once (adapters are float32, a bfloat16 base is not).
        total = weight.float()
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                total = total + layer.get_delta_weight(adapter).detach().float()
        merged[f"{name}.weight"] = total.to(weight.dtype)
    return merged


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """(name, layer) of every layer peft gave LoRA adapters, as `model` names its modules."""
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
            yield name, module
