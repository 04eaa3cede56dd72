"""Weights and rollout batches between real processes (gloo on the CPU, spawned interpreters):
after a sync the actor holds the learner's weights bit for bit (one checksum on both sides), and a
batch arrives as it was sent."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import torch

from rollout.runtime.online.batches import RolloutBatch, from_wire, to_wire
from rollout.runtime.weight_sync import state_checksum


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _batch() -> RolloutBatch:
    return RolloutBatch(
        prompt_ids=[[1, 2, 3], [1, 2, 3], [4]],
        completion_ids=[[5, 6], [7], []],
        old_logprobs=[[-0.5, -1.25], [-2.0], []],
        rewards=torch.tensor([1.0, 0.0, 0.5]),
        advantages=torch.tensor([0.7, -0.7, 0.0]),
        group_size=2,
        policy_version=3,
        texts=["ab", "c", ""],
    )


def _worker(rank: int, store_path: str, out: str) -> None:
    import torch.distributed as dist

    from rollout.runtime import weight_sync

    store = dist.FileStore(store_path, 3)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    try:
        # rank 0: actor, ranks 1 and 2: learners (the first one sends the weights)
        groups = weight_sync.make_groups([0], [1, 2])
        model = _model(seed=rank)  # every rank starts from different weights
        if rank == 1:
            weight_sync.send_weights(groups, model.state_dict(), {"version": 7, "step": 7})
            header, tensors = weight_sync.recv_message(0)
            batch = from_wire(header, tensors)
            assert batch.completion_ids == _batch().completion_ids
            assert batch.old_logprobs == _batch().old_logprobs
            assert torch.equal(batch.advantages, _batch().advantages)
            assert header["metrics"] == {"reward/mean": 0.5} and batch.policy_version == 3
            Path(out, f"{rank}").write_text(state_checksum(model.state_dict()))
        elif rank == 0:
            header, weights = weight_sync.receive_weights(groups, model.state_dict())
            assert header["version"] == 7
            model.load_state_dict(weights)
            Path(out, f"{rank}").write_text(state_checksum(model.state_dict()))
            wire, tensors = to_wire(_batch())
            wire["metrics"] = {"reward/mean": 0.5}
            weight_sync.send_message(wire, tensors, 1).wait()
    finally:
        dist.destroy_process_group()


def test_an_actor_holds_the_learners_weights_after_a_sync(tmp_path) -> None:
    context = multiprocessing.get_context("spawn")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    workers = [
        context.Process(target=_worker, args=(rank, str(tmp_path / "store"), str(tmp_path)))
        for rank in range(3)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=100)
    codes = [worker.exitcode for worker in workers]
    for worker in workers:
        if worker.is_alive():
            worker.kill()
    assert codes == [0, 0, 0]
    actor, learner = (tmp_path / "0").read_text(), (tmp_path / "1").read_text()
    assert actor == learner
    # and the checksum tells different weights apart
    assert state_checksum(_model(0).state_dict()) != state_checksum(_model(1).state_dict())


def test_a_batch_survives_the_wire() -> None:
    header, tensors = to_wire(_batch())
    batch = from_wire(header, tensors)
    assert batch.prompt_ids == _batch().prompt_ids and batch.texts == _batch().texts
    assert torch.equal(batch.rewards, _batch().rewards) and batch.group_size == 2
