"""The collectives' tensors follow the process group's backend: CUDA for NCCL, CPU for gloo."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rollout.runtime import transport
from rollout.runtime.work_queue import WorkQueue


def test_nccl_moves_tensors_from_the_local_gpu_and_gloo_from_the_cpu() -> None:
    assert transport.collective_device("nccl", 3) == torch.device("cuda", 3)
    assert transport.collective_device("gloo", 3) == torch.device("cpu")


def test_the_device_is_chosen_when_joining_and_forgotten_when_leaving(monkeypatch) -> None:
    joined: list[str] = []
    monkeypatch.setattr(transport.dist, "is_initialized", lambda: bool(joined))
    monkeypatch.setattr(
        transport.dist, "init_process_group", lambda backend, timeout: joined.append(backend)
    )
    monkeypatch.setattr(transport.dist, "destroy_process_group", joined.clear)
    transport.join_process_group(2, "nccl", local_rank=1)
    assert joined == ["nccl"] and transport._device == torch.device("cuda", 1)
    transport.leave_process_group()
    assert transport._device == torch.device("cpu")
    transport.join_process_group(1, "nccl", local_rank=1)  # one rank joins nothing
    assert not joined and transport._device == torch.device("cpu")


def test_gloo_collectives_run_on_the_cpu(tmp_path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert transport.sum_metrics([1.0, 2.5]) == [1.0, 2.5]
        assert transport.gather_state({"cursor": [3, "é"]}) == [{"cursor": [3, "é"]}]
    finally:
        dist.destroy_process_group()


def test_the_work_queue_runs_on_the_process_groups_store(tmp_path) -> None:
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0, world_size=1
    )
    try:
        queue = WorkQueue(transport.process_group_store(), step=0, num_items=5, chunk_size=2)
        with queue.actor("rank-0") as actor:
            while (chunk := actor.claim()) is not None:
                actor.complete(chunk, [f"id-{item}" for item in chunk.items])
        assert queue.collect(timeout_s=5) == [f"id-{item}" for item in range(5)]
    finally:
        dist.destroy_process_group()


def test_the_collective_timeout_reaches_the_process_group(monkeypatch) -> None:
    from datetime import timedelta

    seen: list[object] = []
    monkeypatch.setattr(transport.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        transport.dist, "init_process_group", lambda backend, timeout: seen.append(timeout)
    )
    transport.join_process_group(2, "gloo", timeout_s=7.5)
    transport.join_process_group(2, "gloo")  # torch's own default
    assert seen == [timedelta(seconds=7.5), None]
    transport.leave_process_group()
