"""Weights and rollout batches between real processes (gloo on the CPU, spawned interpreters):
after a sync the actor holds the learner's weights bit for bit (one checksum on both sides), and a
batch arrives as it was sent."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import torch

from rollout.runtime.online.batches import RolloutBatch, Sample, concat, from_wire, to_wire
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


def _run_ranks(worker, tmp_path) -> list[int | None]:
    """`worker` on ranks 0..2 (spawned interpreters, gloo): their exit codes."""
    context = multiprocessing.get_context("spawn")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    workers = [
        context.Process(target=worker, args=(rank, str(tmp_path / "store"), str(tmp_path)))
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
    return codes


def test_an_actor_holds_the_learners_weights_after_a_sync(tmp_path) -> None:
    assert _run_ranks(_worker, tmp_path) == [0, 0, 0]
    actor, learner = (tmp_path / "0").read_text(), (tmp_path / "1").read_text()
    assert actor == learner
    # and the checksum tells different weights apart
    assert state_checksum(_model(0).state_dict()) != state_checksum(_model(1).state_dict())


# The actor joins each broadcast this long after the learner started it: mid-generation.
_ACTOR_LATE_S = 1.0


def _publishing_worker(rank: int, store_path: str, out: str) -> None:
    import torch.distributed as dist

    from rollout.runtime import weight_sync

    store = dist.FileStore(store_path, 3)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    try:
        groups = weight_sync.make_groups([0], [1, 2])
        model = _model(seed=rank)
        if rank == 1:
            publisher = weight_sync.WeightPublisher(groups)
            for version in (1, 2):
                sent = state_checksum(model.state_dict())
                started = time.perf_counter()
                publisher.publish(model.state_dict(), {"version": version, "step": version})
                Path(out, f"publish-{version}").write_text(str(time.perf_counter() - started))
                # the next optimizer step, at once: the actor has not taken the weights yet
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.add_(1.0)
                Path(out, f"sent-{version}").write_text(sent)
            publisher.stop({"version": 2, "step": 2})
            assert publisher.broadcast_s is not None and publisher.broadcast_s > 0
        elif rank == 0:
            for version in (1, 2):
                time.sleep(_ACTOR_LATE_S)
                header, weights = weight_sync.receive_weights(groups, model.state_dict())
                assert header["version"] == version
                model.load_state_dict(weights)
                Path(out, f"received-{version}").write_text(state_checksum(model.state_dict()))
            header, weights = weight_sync.receive_weights(groups, model.state_dict())
            assert header["stop"] and weights == {}
    finally:
        dist.destroy_process_group()


def test_the_learner_trains_on_while_the_actor_takes_a_snapshot(tmp_path) -> None:
    """`publish` returns before the actor joins the broadcast, and changing the parameters right
    after it changes nothing the actor receives; the reused buffers carry the next version."""
    assert _run_ranks(_publishing_worker, tmp_path) == [0, 0, 0]
    for version in (1, 2):
        assert (tmp_path / f"received-{version}").read_text() == (
            tmp_path / f"sent-{version}"
        ).read_text()
    # the first publish cannot have waited for the actor (which joins _ACTOR_LATE_S later);
    # the second waited for the first broadcast, no more
    assert float((tmp_path / "publish-1").read_text()) < _ACTOR_LATE_S / 2
    assert (tmp_path / "received-1").read_text() != (tmp_path / "received-2").read_text()


def test_a_batch_survives_the_wire() -> None:
    header, tensors = to_wire(_batch())
    batch = from_wire(header, tensors)
    assert batch.prompt_ids == _batch().prompt_ids and batch.texts == _batch().texts
    assert torch.equal(batch.rewards, _batch().rewards) and batch.group_size == 2
    assert batch.samples == []


def test_samples_cross_with_a_batch_and_concatenate_in_order() -> None:
    sent = []
    for part in range(2):
        batch = _batch()
        batch.samples = [Sample(f"p{part}", f"c{part}", None, 0.5, {"finish_reason": "eos"})]
        sent.append(from_wire(*to_wire(batch)))
    assert [s.completion for s in concat(sent).samples] == ["c0", "c1"]
    assert sent[0].samples[0].extra == {"finish_reason": "eos"}
    assert sent[0].select([0]).samples == []  # minibatches do not carry them
