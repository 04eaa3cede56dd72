"""Everything that travels between ranks, and the process group it travels in.

Every torch.distributed call of the runtime is here, named after what moves: gradients (averaged
before an optimizer step), metrics and token counts (summed or averaged over ranks), a batch's
per-record values (gathered), small state (data cursors, RNG states, shares of the reference
log-probs), and the process group's key-value store (`process_group_store`, through which the
work queue hands out a step's prompts). This is the seam along which actor and learner will be
split into processes of their own.

Collectives over ranks run among the learners (`train_among`; colocated, that is every rank);
what crosses from actors to learners (rollout batches, weights) is in rollout.runtime.weight_sync.

Two kinds of calls. Those that take a step's tensors (gradients, token counts, batch values) ask
the process group whether there are several ranks (`several_ranks`) and do nothing with one.
Those a loop calls with the plan's world size in hand (metrics, state, the barrier) are
collectives every rank must enter: the caller calls them only when its world has several ranks.

State never travels pickled (torch.distributed's *_object collectives pickle their payload, and a
worker must never unpickle bytes from another process): it is small and JSON-able, so it travels
as UTF-8 JSON in uint8 tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

# --- the process group ---------------------------------------------------------------------------


_device = torch.device("cpu")
"""Where the tensors this module makes travel from: the process group's backend decides, once, at
join time (NCCL moves CUDA tensors only; gloo, and a single rank, use the CPU)."""

_learners: Any = None
"""The process group the learner ranks share: gradients, token counts, metrics and checkpoint
state travel in it. None: the whole world (colocated, every rank is a learner)."""


def join_process_group(
    world_size: int, backend: str, local_rank: int = 0, timeout_s: float | None = None
) -> None:
    """Join the run's ranks (torchrun's environment says where they meet); one rank joins none.
    With NCCL, metrics, counts and state travel from cuda:`local_rank`. A collective that waits
    longer than `timeout_s` for the other ranks raises (None: torch's default) rather than hang."""
    global _device
    if world_size > 1 and not dist.is_initialized():
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        dist.init_process_group(backend=backend, timeout=timeout)
        _device = collective_device(backend, local_rank)


def collective_device(backend: str, local_rank: int) -> torch.device:
    """The device a backend's collectives take tensors on: cuda:`local_rank` for NCCL, else CPU."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def leave_process_group() -> None:
    global _device, _learners
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _device = torch.device("cpu")
    _learners = None


def train_among(group: Any) -> None:
    """Make `group` (a learner group from rollout.runtime.weight_sync.make_groups) the group the
    learner collectives of this module run in."""
    global _learners
    _learners = group


def several_ranks() -> bool:
    """Whether this process is one of several learner ranks in a process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(_learners) > 1


def process_group_store() -> dist.Store:
    """The key-value store the process group's ranks met through (torchrun's TCPStore), for
    small coordination that is not a collective: rollout/runtime/work_queue.py's chunk claims."""
    return dist.distributed_c10d._get_default_store()


def wait_for_every_rank() -> None:
    """Return once every learner rank got here (collective)."""
    dist.barrier(group=_learners)


# --- gradients -----------------------------------------------------------------------------------


def average_gradients(params: Iterable[torch.Tensor]) -> None:
    """Replace each parameter's gradient by its mean over ranks (in place; every rank passes the
    same parameters in the same order). Parameters without a gradient, and sharded ones (already
    averaged), are left alone."""
    if not several_ranks():
        return
    world = dist.get_world_size(_learners)
    for param in params:
        # A sharded learner's gradients (DTensors) were averaged by FSDP's reduce-scatter in
        # the backward; reducing them again would sum different ranks' shards.
        if param.grad is not None and not isinstance(param.grad, DTensor):
            dist.all_reduce(param.grad, group=_learners)
            param.grad /= world


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a plain tensor: a replicated DTensor (a sharded model's gradient norm, the
    whole gradient's) gives its local value, which every rank holds the same of."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# --- metrics and counts --------------------------------------------------------------------------


def sum_metrics(values: list[float]) -> list[float]:
    """Element-wise sums of every rank's `values` (the same length everywhere); collective."""
    stacked = torch.tensor(values, dtype=torch.float64, device=_device)
    dist.all_reduce(stacked, group=_learners)
    return stacked.tolist()


def average_token_count(tokens: float) -> float:
    """The mean over ranks of each rank's `tokens` (this rank's alone without ranks): gradients
    are averaged over ranks, so dividing each rank's sum by the mean count makes the average the
    token mean over every rank's tokens."""
    if not several_ranks():
        return tokens
    count = torch.tensor([tokens], dtype=torch.float64, device=_device)
    dist.all_reduce(count, group=_learners)
    return count.item() / dist.get_world_size(_learners)


# --- batches -------------------------------------------------------------------------------------


def gather_batch(values: torch.Tensor) -> torch.Tensor:
    """Every rank's [N] values of its share of a batch, concatenated in rank order (this rank's
    alone without ranks)."""
    if not several_ranks():
        return values
    moving = values.to(_device).contiguous()  # a no-op where the backend takes them as they are
    parts = [torch.empty_like(moving) for _ in range(dist.get_world_size(_learners))]
    dist.all_gather(parts, moving, group=_learners)
    return torch.cat(parts).to(values.device)


# --- state ---------------------------------------------------------------------------------------


def gather_state(value: Any) -> list[Any]:
    """Every learner rank's ``value``, in rank order (JSON-able values only); collective."""
    payload = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=_device)
    world = dist.get_world_size(_learners)
    sizes = [torch.zeros(1, dtype=torch.long, device=_device) for _ in range(world)]
    size = torch.tensor([payload.numel()], dtype=torch.long, device=_device)
    dist.all_gather(sizes, size, group=_learners)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=_device)
    padded[: payload.numel()] = payload
    buffers = [torch.zeros(longest, dtype=torch.uint8, device=_device) for _ in range(world)]
    dist.all_gather(buffers, padded, group=_learners)
    return [
        json.loads(bytes(buffer[: int(size.item())].cpu().tolist()).decode())
        for buffer, size in zip(buffers, sizes, strict=True)
    ]


# --- sharded learners (FSDP2; the policy is rollout.runtime.sharding's) ---------------------------

# The first learner gathers every tensor, to its CPU (a full copy on each GPU would defeat the
# sharding). Not torch.distributed.checkpoint's full state dicts for that: they keep the gathered
# state on global rank 0 and broadcast from it in the default group, and in a disaggregated world
# global rank 0 is an actor, which takes no part in the learners' collectives.
_FULL = StateDictOptions(full_state_dict=False)
# Colocated, rank 0's full state is sent to every rank, which keeps its own shard of it.
_SCATTER = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
# Disaggregated, every learner read the full state itself and keeps its own shard of it.
_DISTRIBUTE = StateDictOptions(full_state_dict=True)


def shard_module(
    model: torch.nn.Module,
    units: list[torch.nn.Module],
    device_type: str,
    *,
    param_dtype: str | None,
    reduce_dtype: str | None,
) -> None:
    """Shard `model` over every learner rank with FSDP2 (in place): each of `units` is gathered
    whole around its own forward, the rest of `model` around the root's. The dtypes
    ("bfloat16", "float32") are what layers compute and gradients reduce in; None: the
    weights' own."""
    if _learners is None:  # colocated: every rank is a learner
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    else:  # the learners' ranks only: the world holds actors too
        mesh = DeviceMesh.from_group(_learners, device_type)
    policy = MixedPrecisionPolicy(
        param_dtype=getattr(torch, param_dtype) if param_dtype else None,
        reduce_dtype=getattr(torch, reduce_dtype) if reduce_dtype else None,
    )
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def is_sharded(model: Any) -> bool:
    """Whether `model` was sharded by `shard_module`."""
    return isinstance(model, FSDPModule)


def first_learner_reads_alone() -> bool:
    """Whether a resumed sharded learner reads its checkpoint on the first learner alone, which
    sends every other learner its shards (colocated), or on every learner (disaggregated: the
    learners' group is not the default group that torch's broadcast from rank 0 runs in)."""
    return _learners is None


def gather_full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A sharded model's whole state_dict (every name, a tied tensor under each) on the first
    learner's CPU ({} on the others); collective over the learners."""
    return _gather_full(model.state_dict())


def gather_full_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's whole state_dict, keyed by parameter name, on the first learner's CPU
    ({} on the others); collective over the learners."""
    return _gather_full(get_optimizer_state_dict(model, optimizer, options=_FULL))


def _gather_full(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with each DTensor made whole (a collective over its mesh, in the order every
    learner walks the same state), on the first learner's CPU; {} on the other learners."""
    keeps = dist.get_rank(_learners) == 0
    gathered: dict[int, torch.Tensor] = {}  # a tied tensor is gathered once

    def walk(value: Any) -> Any:
        if isinstance(value, DTensor):
            if id(value) not in gathered:
                whole = value.full_tensor()  # every learner takes part; one keeps it
                gathered[id(value)] = whole.detach().cpu() if keeps else whole[:0]
            return gathered[id(value)]
        if isinstance(value, torch.Tensor):
            return value.detach().cpu() if keeps else value
        if isinstance(value, dict):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, list):
            return [walk(item) for item in value]
        return value

    full = walk(state)
    return full if keeps else {}


def scatter_full_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load the whole `weights` into each learner's shards: from the first learner (every other
    passes {}) when `first_learner_reads_alone`, else from each learner's own full copy."""
    options = _SCATTER if first_learner_reads_alone() else _DISTRIBUTE
    set_model_state_dict(model, weights, options=options)


def scatter_full_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """Load the whole optimizer `state`, keyed by parameter name, into each learner's shards of
    it: as `scatter_full_weights` takes the weights."""
    options = _SCATTER if first_learner_reads_alone() else _DISTRIBUTE
    set_optimizer_state_dict(model, optimizer, state, options=options)
