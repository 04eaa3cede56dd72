"""LoRA layers (peft's) in the written-out decoder: a linear layer's weight as the model computes it.

LlamaDecoder reads each projection's weight and runs its own GEMM; a peft LoRA layer computes
base(x) + B(A(x)) * scaling, which reading the base weight alone would silently drop. Here the
decoder learns what a layer really computes, without ever changing the model's weights:

- packed kernels take a merged copy, W + B @ A * scaling (packing copies the weight anyway, so
  merging costs no memory that packing did not already take);
- the plain GEMM keeps the base weight and adds the low-rank product on the fly, as peft does
  (no copy of the weights beside the model, and bfloat16 rounds as in the learner's forward).

Nothing is merged into the model in place: merging and unmerging after every update would round
the base weights a little differently each time, and the base must stay the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def is_lora_linear(module: torch.nn.Module) -> bool:
    """A peft LoRA layer over a plain nn.Linear whose adapters are plain LoRA (no DoRA or other
    variant, no LoRA bias, not merged into the base): what LowRank reproduces exactly."""
    kind = type(module)
    if kind.__name__ != "Linear" or not kind.__module__.startswith("peft.tuners.lora"):
        return False
    return (
        type(getattr(module, "base_layer", None)) is torch.nn.Linear
        and not module.merged
        and not module.fan_in_fan_out
        # Attributes of some peft versions only (variants such as DoRA, LoRA biases).
        and not getattr(module, "lora_variant", None)
        and not any(getattr(module, "use_dora", {}).values())
        and not any(getattr(module, "lora_bias", {}).values())
    )


def is_linear(module: torch.nn.Module) -> bool:
    """An nn.Linear, or a LoRA layer over one that the decoder can compute."""
    return type(module) is torch.nn.Linear or is_lora_linear(module)


def base_linear(module: torch.nn.Module) -> torch.nn.Linear:
    """The nn.Linear holding the base weight and bias."""
    return module.base_layer if is_lora_linear(module) else module


@dataclass(frozen=True)
class LowRank:
    """One adapter of a layer: x -> B(A(x)) * scaling."""

    a: torch.Tensor
    """[r, in]"""
    b: torch.Tensor
    """[out, r]"""
    scaling: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[N, out] from x [N, in], in the adapter's dtype as peft computes it."""
        x = x.to(self.a.dtype)
        return torch.nn.functional.linear(torch.nn.functional.linear(x, self.a), self.b) * (
            self.scaling
        )


def low_ranks(module: torch.nn.Module) -> list[LowRank]:
    """The adapters a LoRA layer applies now: none for a plain layer or while they are off."""
    if not is_lora_linear(module) or module.disable_adapters:
        return []
    return [
        LowRank(
            module.lora_A[name].weight.detach(),
            module.lora_B[name].weight.detach(),
            module.scaling[name],
        )
        for name in module.active_adapters
        if name in module.lora_A
    ]


def effective_weight(module: torch.nn.Module) -> torch.Tensor:
    """The weight the layer computes with: the base weight itself for a plain layer (or one
    whose adapters are off), else a new merged tensor W + sum of B @ A * scaling."""
    weight = base_linear(module).weight
    terms = low_ranks(module)
    if not terms:
        return weight
    # Summed in float32 and rounded once (peft keeps adapters in float32 over a bfloat16 base).
    merged = weight.detach().float()
    for term in terms:
        merged = merged + (term.b.float() @ term.a.float()) * term.scaling
    return merged.to(weight.dtype)


def adapted_output(x: torch.Tensor, base: torch.Tensor, terms: list[LowRank]) -> torch.Tensor:
    """The LoRA layer's output from its base output `base` [N, out] and input x [N, in]."""
    result = base
    for term in terms:
        result = result + term(x)
    return result.to(base.dtype)
