"""What crosses between the actor and learner processes of a disaggregated run, and the groups it
crosses in: rollout batches (each actor to each learner, point to point) and the policy's weights
(the first learner to every actor, one broadcast).

The torch.distributed calls of the split live here, beside rollout.runtime.transport (which holds
the learners' own collectives). As there, nothing travels pickled: a message is a small JSON
header in a uint8 tensor, then plain tensors whose dtypes and sizes the header lists.

Groups are made by `make_groups`, which every rank calls in the same order with the same ranks
(torch.distributed requires it of `new_group`, members or not).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rollout.runtime import transport

_DTYPES = {
    str(dtype): dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
    )
}


@dataclass(frozen=True)
class Groups:
    """The process groups of a disaggregated run, as this rank holds them."""

    actors: list[int]
    learners: list[int]
    learner_group: Any
    """The learners' data-parallel group (gradients, metrics, checkpoint state)."""
    sync_group: Any
    """The first learner and every actor: the weights' broadcast."""

    @property
    def source(self) -> int:
        """The rank whose weights the actors take: the first learner."""
        return self.learners[0]


def make_groups(actors: Sequence[int], learners: Sequence[int]) -> Groups:
    """The run's groups (collective over every rank: each calls it with the same ranks)."""
    learner_group = dist.new_group(list(learners))
    sync_group = dist.new_group([learners[0], *actors])
    return Groups(list(actors), list(learners), learner_group, sync_group)


# --- messages: a JSON header, then tensors -------------------------------------------------------


@dataclass
class Sent:
    """Sends in flight: the tensors stay referenced until every send completed."""

    works: list[Any] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)

    def done(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def send_message(
    header: Mapping[str, Any], tensors: Sequence[torch.Tensor], dst: int, tag: int = 0
) -> Sent:
    """Start sending `header` (JSON data) and `tensors` to global rank `dst`, without waiting
    for it to take them (the sender goes on generating); `recv_message` on `dst` with the same
    `tag` takes them. Gloo matches sends to receives by tag; NCCL ignores tags and matches in
    order, so a receiver takes each sender's messages in the order they were sent either way."""
    moving = [t.detach().reshape(-1).contiguous().to(transport._device) for t in tensors]
    described = {**header, "tensors": [[str(t.dtype), t.numel()] for t in moving]}
    payload = _json_tensor(described)
    size = torch.tensor([payload.numel()], dtype=torch.long, device=transport._device)
    sent = Sent(tensors=[size, payload, *moving])
    sent.works = [dist.isend(t, dst, tag=tag) for t in sent.tensors]
    return sent


def recv_message(src: int, tag: int = 0) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The next message global rank `src` sent this rank with `tag`: its header, and its
    tensors (flat, on the CPU) in the order they were sent."""
    size = torch.zeros(1, dtype=torch.long, device=transport._device)
    dist.recv(size, src, tag=tag)
    payload = torch.zeros(int(size.item()), dtype=torch.uint8, device=transport._device)
    dist.recv(payload, src, tag=tag)
    header = json.loads(payload.cpu().numpy().tobytes().decode())
    tensors = []
    for dtype, numel in header.pop("tensors"):
        buffer = torch.empty(numel, dtype=_DTYPES[dtype], device=transport._device)
        dist.recv(buffer, src, tag=tag)
        tensors.append(buffer.cpu())
    return header, tensors


# --- weights -------------------------------------------------------------------------------------


def send_weights(
    groups: Groups, weights: Mapping[str, torch.Tensor], header: Mapping[str, Any]
) -> None:
    """The first learner's side of a sync: `header` (the version, the step, a stop), then every
    tensor of `weights` in order, to every actor (collective over the sync group)."""
    names = {"names": [[name, list(t.shape)] for name, t in weights.items()]}
    _broadcast_json(groups, {**header, **names})
    for tensor in weights.values():
        dist.broadcast(
            tensor.detach().contiguous().to(transport._device),
            groups.source,
            group=groups.sync_group,
        )


def send_stop(groups: Groups, header: Mapping[str, Any]) -> None:
    """Tell the actors the run ends here: a header with no weights after it."""
    _broadcast_json(groups, {**header, "stop": True, "names": []})


def receive_weights(
    groups: Groups, like: Mapping[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An actor's side of a sync: the header and the weights, in tensors shaped as `like` (the
    actor's own state dict, which must name the same tensors as the learner's, in its order)."""
    header = _broadcast_json(groups, None)
    names = header.pop("names")
    if header.get("stop"):
        return header, {}
    ours = [[name, list(t.shape)] for name, t in like.items()]
    if names != ours:
        raise RuntimeError(
            "the learner's policy and this actor's differ in their tensors "
            f"({len(names)} vs {len(ours)}; first difference: "
            f"{next((a, b) for a, b in zip(names, ours, strict=False) if a != b) if names and ours else '-'}"
            "): both must be built from the same plan"
        )
    weights = {}
    for name, tensor in like.items():
        buffer = torch.empty_like(tensor, device=transport._device)
        dist.broadcast(buffer, groups.source, group=groups.sync_group)
        weights[name] = buffer.to(tensor.device)
    return header, weights


def state_checksum(weights: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes: equal on two processes exactly
    when they hold the same weights, bit for bit."""
    digest = hashlib.sha256()
    for name, tensor in weights.items():
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)};".encode())
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _broadcast_json(groups: Groups, value: Any) -> Any:
    """`value` from the first learner to every actor (the receivers pass None)."""
    group, source = groups.sync_group, groups.source
    sending = value is not None
    payload = _json_tensor(value) if sending else None
    size = torch.tensor(
        [payload.numel() if payload is not None else 0], dtype=torch.long, device=transport._device
    )
    dist.broadcast(size, source, group=group)
    if payload is None:
        payload = torch.zeros(int(size.item()), dtype=torch.uint8, device=transport._device)
    dist.broadcast(payload, source, group=group)
    return value if sending else json.loads(payload.cpu().numpy().tobytes().decode())


def _json_tensor(value: Any) -> torch.Tensor:
    return torch.tensor(
        list(json.dumps(value).encode()), dtype=torch.uint8, device=transport._device
    )
