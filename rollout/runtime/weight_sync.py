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
import time
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
    """The first learner's side of a sync, waited for: `header` (the version, the step, a stop),
    then every tensor of `weights` in order, to every actor (collective over the sync group).
    A learner that goes on training while the actors take them publishes through a
    `WeightPublisher` instead."""
    publisher = WeightPublisher(groups)
    publisher.publish(weights, header)
    publisher.wait()


class WeightPublisher:
    """The first learner's side of the syncs, asynchronous: `publish` copies the weights into
    buffers kept from one sync to the next (a device-side copy on CUDA; no allocation after the
    first), starts broadcasting the copy and returns, so the learner trains its next step while
    the actors, mid-generation, have not joined yet. The copy is what makes this safe: the next
    optimizer step changes the live parameters, never the tensors in flight.

    Each `publish`, `stop` and `wait` first waits for the broadcast before it (the buffers are
    reused, and the actors take the syncs in order); the learner calls `wait` before it ends.
    """

    def __init__(self, groups: Groups):
        self.groups = groups
        self._buffers: dict[str, torch.Tensor] = {}
        self._works: list[Any] = []
        self._keep: list[torch.Tensor] = []  # the header's tensors, referenced until sent
        self._issued = 0.0
        self._completed: list[float] = []  # the broadcast's completion time, once it came
        self.broadcast_s: float | None = None
        """How long the last broadcast waited for, issue to completion (None before one)."""

    def publish(self, weights: Mapping[str, torch.Tensor], header: Mapping[str, Any]) -> None:
        """Start sending `header`, then a snapshot of every tensor of `weights` in order."""
        self.wait()
        snapshot = self._snapshot(weights)
        names = {"names": [[name, list(t.shape)] for name, t in weights.items()]}
        self._issued = time.perf_counter()
        completed: list[float] = []  # this broadcast's own: a late callback cannot mark the next
        self._completed = completed
        self._works, self._keep = _broadcast_json_async(self.groups, {**header, **names})
        for tensor in snapshot:
            self._works.append(
                dist.broadcast(
                    tensor, self.groups.source, group=self.groups.sync_group, async_op=True
                )
            )
        # when the actors took the last of it (a callback on gloo's or NCCL's own thread)
        self._works[-1].get_future().then(lambda _: completed.append(time.perf_counter()))

    def stop(self, header: Mapping[str, Any]) -> None:
        """Tell the actors the run ends here (after the broadcast in flight, if any)."""
        self.wait()
        send_stop(self.groups, header)

    def wait(self) -> None:
        """Block until the broadcast in flight, if any, completed."""
        if not self._works:
            return
        for work in self._works:
            work.wait()
        completed = self._completed[0] if self._completed else time.perf_counter()
        self.broadcast_s = max(0.0, completed - self._issued)
        self._works, self._keep = [], []

    def _snapshot(self, weights: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """`weights` copied into this publisher's buffers (made again only if the names, shapes
        or dtypes changed, which a policy's do not between syncs)."""
        like = [(name, t.shape, t.dtype) for name, t in weights.items()]
        held = [(name, t.shape, t.dtype) for name, t in self._buffers.items()]
        if like != held:
            self._buffers = {
                name: torch.empty(t.shape, dtype=t.dtype, device=transport._device)
                for name, t in weights.items()
            }
        with torch.no_grad():
            for name, tensor in weights.items():
                self._buffers[name].copy_(tensor.detach())
        return list(self._buffers.values())


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


def _broadcast_json_async(groups: Groups, value: Any) -> tuple[list[Any], list[torch.Tensor]]:
    """`_broadcast_json`'s sending side, started without waiting: the works, and the tensors they
    send (to keep referenced until they complete)."""
    payload = _json_tensor(value)
    size = torch.tensor([payload.numel()], dtype=torch.long, device=transport._device)
    works = [
        dist.broadcast(t, groups.source, group=groups.sync_group, async_op=True)
        for t in (size, payload)
    ]
    return works, [size, payload]


def _json_tensor(value: Any) -> torch.Tensor:
    return torch.tensor(
        list(json.dumps(value).encode()), dtype=torch.uint8, device=transport._device
    )
