"""Training precision (model.precision, resolved by the plan into derived.precision):

- "none": weights, gradients and AdamW's moments all in model.dtype. In bfloat16 an update
  smaller than half a unit in the last place of a weight (2^-8 of its size: lr 1e-6 on a weight
  of 0.01 moves it by 1e-6 < 3.9e-5) rounds away, every step: the weight never moves.
- "autocast": float32 weights, gradients and moments; the forward passes run under
  torch.autocast to bfloat16 (matmuls in bfloat16, reductions in float32). The backward follows
  the forward's dtypes. Twice the weight memory of bfloat16, the speed of bfloat16 matmuls.
- "master_weights": bfloat16 weights and gradients (what the forward, the backward and the
  engine use), and a float32 copy of every weight kept by the optimizer (MasterWeightAdamW):
  the step updates the float32 copy, where small updates add up, and rounds it into the
  bfloat16 weight. 12 bytes a parameter of optimizer state (copy and two moments).

A checkpoint saves the optimizer's state, so the float32 copies are saved with it, and a resumed
run continues from them exactly (not from the rounded bfloat16 weights).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adam import adam

PRECISIONS = ("none", "autocast", "master_weights")


def autocast_dtype(precision: str) -> str | None:
    """The dtype forward passes autocast to under plan.derived.precision, or None."""
    return "bfloat16" if precision == "autocast" else None


def autocast(device: torch.device | str, dtype: str | None) -> contextlib.AbstractContextManager:
    """torch.autocast to `dtype` ("bfloat16") on `device`'s kind, or a context that does
    nothing when `dtype` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=getattr(torch, dtype))


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over float32 copies of low-precision parameters.

    param_groups hold the model's own parameters (so an lr scheduler, zero_grad, gradient
    clipping and the checkpoint's parameter order work as with torch's AdamW). The state of each
    parameter holds its float32 copy ("master"), the two moments (float32) and the step count.
    A step casts the gradients to float32, runs torch's AdamW on the copies (fused when asked),
    and copies them, rounded, into the parameters.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        fused: bool = False,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)
        super().__init__(params, defaults)
        # The copies are taken now, from the weights as they are: before any step, so the
        # memory they take is there from the start, and a checkpoint of step 0 has them.
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param] = self._fresh_state(param, group["fused"])

    @staticmethod
    def _fresh_state(param: torch.Tensor, fused: bool) -> dict[str, torch.Tensor]:
        master = param.detach().to(torch.float32, copy=True)
        # The fused kernel takes the step count as a float32 tensor on the parameters' device.
        step_device = param.device if fused else torch.device("cpu")
        return {
            "step": torch.zeros((), dtype=torch.float32, device=step_device),
            "master": master,
            "exp_avg": torch.zeros_like(master),
            "exp_avg_sq": torch.zeros_like(master),
        }

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self.state[p] for p in params]
            masters = [s["master"] for s in states]
            beta1, beta2 = group["betas"]
            adam(
                masters,
                [p.grad.to(torch.float32) for p in params],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [],
                [s["step"] for s in states],
                foreach=None if not group["fused"] else False,
                fused=group["fused"] or None,
                decoupled_weight_decay=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
            torch._foreach_copy_(params, masters)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load casts every floating-point state tensor to its parameter's dtype, which
        would round the float32 copies and moments to bfloat16: they are put back as saved."""
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(saved_id, {})
            for name in ("master", "exp_avg", "exp_avg_sq"):
                if name in saved:
                    self.state[param][name] = saved[name].to(param.device, torch.float32)
