"""The learner sharded with FSDP2 (cluster.sharding = "fsdp"): weights, gradients and optimizer
state split over the ranks, each holding about 1/N of them.

`shard_learner` wraps a loaded model in place: each decoder layer is one FSDP unit (gathered whole
just before it runs, resharded after), then the root (embeddings, final norm, head). The module
keeps its class, names and forward; its parameters become DTensors. What changes for the loops:

- gradients come out of the backward already reduce-scattered (averaged over ranks) into each
  rank's shard, so rollout.runtime.transport.average_gradients leaves DTensor gradients alone;
- torch.nn.utils.clip_grad_norm_ over DTensor gradients computes the norm of the whole gradient
  (every rank's shard), a replicated DTensor;
- a model's weights must be read through its forward (which gathers them), never as tensors:
  rollout.runtime.logprobs takes the model's own forward for a sharded model;
- a checkpoint gathers the full state on the first learner (`gather_full_state`), which writes
  it in the layout of a replicated run, and a resumed run scatters it back from there
  (`ShardedLoader`; disaggregated, every learner reads the files and keeps its shard);
- with actors on processes of their own, the learners shard over their own group (a 1-D mesh
  of the learner ranks), and each weight sync gathers the whole policy on the first learner
  (`whole_weights`) before it is broadcast to the actors.

The torch.distributed calls themselves (fully_shard, the full state dicts) are
rollout.runtime.transport's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rollout.runtime import transport
from rollout.runtime.checkpoint import FullState

if TYPE_CHECKING:
    from rollout.runtime.context import WorkerContext


def is_sharded(model: Any) -> bool:
    """Whether `model` was wrapped by `shard_learner`."""
    return transport.is_sharded(model)


def shard_learner(ctx: WorkerContext, model: torch.nn.Module) -> torch.nn.Module:
    """`model` sharded over the run's learner ranks (every rank, colocated) when cluster.sharding is "fsdp" (in place; the same
    object is returned), else `model` as it is. Call it before the optimizer is built: the
    optimizer must hold the sharded parameters. Every rank must pass the same weights."""
    cluster = ctx.plan.config.cluster
    if cluster.sharding != "fsdp":
        return model
    mixed = cluster.fsdp_mixed_precision
    # The run's process group (gloo on the CPU, NCCL on GPUs), on this rank's device kind: the
    # worker already made cuda:LOCAL_RANK the current device.
    transport.shard_module(
        model,
        decoder_layers(model),
        torch.device(ctx.device).type,
        param_dtype=mixed.param_dtype if mixed is not None else None,
        reduce_dtype=mixed.reduce_dtype if mixed is not None else None,
    )
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model: the classes it names as never to be split
    across devices (_no_split_modules: LlamaDecoderLayer, Qwen2DecoderLayer, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules): "
            "cluster.sharding = 'fsdp' cannot find the blocks to shard"
        )
    return layers


def whole_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights as actors take them (rollout.runtime.weight_sync.send_weights):
    `model.state_dict()`, or a sharded model's gathered whole on the first learner's CPU, under
    every name a tied tensor has ({} on the other learners; collective: every learner calls
    it)."""
    if not is_sharded(model):
        return model.state_dict()
    return transport.gather_full_weights(model)


def first_learner_reads_alone() -> bool:
    """Whether a resumed sharded run reads its checkpoint on the first learner alone (colocated)
    or on every learner (disaggregated); rollout.runtime.transport says why."""
    return transport.first_learner_reads_alone()


# --- checkpoints ---------------------------------------------------------------------------------


def gather_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> FullState:
    """The whole model's weights and (when `optimizer` is given) the optimizer's state, on the
    first learner's CPU (empty on every other); collective. Tied weights appear once, under their
    first name; the optimizer state is keyed by parameter index, as Optimizer.state_dict() keys it."""
    weights = transport.gather_full_weights(model)
    names = _parameter_names(model)
    if optimizer is None:
        return FullState(weights=_first_names(model, weights), optimizer=None)
    by_name = transport.gather_full_optimizer(model, optimizer)
    return FullState(
        weights=_first_names(model, weights),
        optimizer=_by_index(by_name, _names_in_order(optimizer, names)) if by_name else None,
    )


@dataclass
class ShardedLoader:
    """Restores a sharded model and optimizer from full state read by rank 0 alone
    (rollout.runtime.checkpoint.load_checkpoint's `full_state`); collective."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    reads: bool
    """Whether this rank reads the files (rank 0); the others are sent what it read."""

    def weights(self, saved: dict[str, torch.Tensor]) -> None:
        transport.scatter_full_weights(self.model, saved)

    def optimizer_state(self, state_dict: dict[str, Any]) -> None:
        assert self.optimizer is not None
        names = _names_in_order(self.optimizer, _parameter_names(self.model))
        by_name = _by_name(state_dict, names) if self.reads else {}
        transport.scatter_full_optimizer(self.model, self.optimizer, by_name)


def _parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """Each parameter's first name (a tied one has several), by its id."""
    return {id(param): name for name, param in model.named_parameters()}


def _names_in_order(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[str]:
    """The optimizer's parameters' names, in the order its state_dict numbers them."""
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _first_names(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`weights` with each tied tensor under its first name only, as save_pretrained keeps it."""
    keep, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen and name in weights:
            seen.add(id(tensor))
            keep[name] = weights[name]
    return keep


def _by_index(by_name: dict[str, Any], order: list[str]) -> dict[str, Any]:
    index = {name: i for i, name in enumerate(order)}
    return {
        "state": {index[name]: state for name, state in by_name["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]}
            for group in by_name["param_groups"]
        ],
    }


def _by_name(by_index: dict[str, Any], order: list[str]) -> dict[str, Any]:
    return {
        "state": {order[int(i)]: state for i, state in by_index["state"].items()},
        "param_groups": [
            {**group, "params": [order[int(i)] for i in group["params"]]}
            for group in by_index["param_groups"]
        ],
    }
