"""A sharded learner group's weight sync and checkpoint state on real processes (gloo on the CPU,
spawned interpreters): rank 0 an actor, ranks 1 and 2 learners sharding the tiny model over their
own group. After a step and a sync the actor holds the whole trained policy, bit for bit (one
checksum on both sides), and the gathered full state scattered into fresh shards, every learner
reading its own copy as a resumed disaggregated run does, gathers back to the same weights.
Three interpreters loading torch and transformers take 25-50 s here, so it is marked slow."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollout.models.builtin_build import build_tiny
from rollout.runtime.weight_sync import state_checksum


def _model(directory: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def _learner(rank: int, groups, model_dir: str, out: str) -> None:
    from rollout.runtime import sharding, transport, weight_sync

    transport.train_among(groups.learner_group)
    cluster = SimpleNamespace(sharding="fsdp", fsdp_mixed_precision=None)
    ctx = SimpleNamespace(plan=SimpleNamespace(config=SimpleNamespace(cluster=cluster)))
    ctx.device = "cpu"
    model = sharding.shard_learner(ctx, _model(model_dir))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(rank))
    model(input_ids=rows, labels=rows).loss.backward()
    optimizer.step()

    weights = sharding.whole_weights(model)  # every learner takes part in the gather
    if rank == groups.source:
        weight_sync.send_weights(groups, weights, {"version": 1, "step": 1})
        Path(out, "learner").write_text(state_checksum(weights))
    else:
        assert weights == {}  # gathered on the first learner only

    full = sharding.gather_full_state(model, optimizer)
    if rank == groups.source:
        torch.save(full.weights, Path(out, "full.pt"))  # test files only: written, read here
        torch.save(full.optimizer, Path(out, "optimizer.pt"))
    transport.wait_for_every_rank()
    assert not sharding.first_learner_reads_alone()
    fresh = sharding.shard_learner(ctx, _model(model_dir))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    loader = sharding.ShardedLoader(fresh, fresh_optimizer, reads=True)
    saved = torch.load(Path(out, "full.pt"))
    # Saved once per tied tensor; loaded under every name the model has for it.
    state = fresh.state_dict(keep_vars=True)
    first = {id(tensor): name for name, tensor in state.items() if name in saved}
    loader.weights({name: saved[first[id(tensor)]] for name, tensor in state.items()})
    loader.optimizer_state(torch.load(Path(out, "optimizer.pt")))
    again = sharding.whole_weights(fresh)
    if rank == groups.source:
        Path(out, "restored").write_text(state_checksum(again))


def _worker(rank: int, store_path: str, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from rollout.runtime import transport, weight_sync

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 3)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    try:
        groups = weight_sync.make_groups([0], [1, 2])
        if rank == 0:
            model = _model(model_dir)
            Path(out, "initial").write_text(state_checksum(model.state_dict()))
            header, weights = weight_sync.receive_weights(groups, model.state_dict())
            assert header["version"] == 1
            model.load_state_dict(weights)
            Path(out, "actor").write_text(state_checksum(model.state_dict()))
        else:
            _learner(rank, groups, model_dir, out)
    finally:
        transport.leave_process_group()


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny("tiny-llama", tmp_path_factory.mktemp("tiny") / "model")


def test_actor_holds_the_sharded_learners_whole_policy_after_a_sync(model_dir, tmp_path):
    context = multiprocessing.get_context("spawn")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    store = str(tmp_path / "store")
    workers = [
        context.Process(target=_worker, args=(rank, store, str(model_dir), str(tmp_path)))
        for rank in range(3)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    codes = [worker.exitcode for worker in workers]
    for worker in workers:
        if worker.is_alive():
            worker.kill()
    assert codes == [0, 0, 0]
    actor, learner = (tmp_path / "actor").read_text(), (tmp_path / "learner").read_text()
    assert actor == learner
    assert actor != (tmp_path / "initial").read_text()  # the step moved the weights
    assert (tmp_path / "restored").read_text() == learner
