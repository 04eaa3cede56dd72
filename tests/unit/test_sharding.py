"""rollout.runtime.sharding on two real CPU ranks (gloo, torch.multiprocessing): an FSDP2 step
equals the single-process step on the same batch (loss, gradient norm, weights), the full state
gathered to rank 0 is the single-process model's, and scattering it back restores the shards.
Ranks report through safetensors and JSON files, never pickles."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from rollout.models.builtin_build import build_tiny
from rollout.runtime import sharding, transport

LR = 1e-2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(directory: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def _batch() -> torch.Tensor:
    return torch.randint(0, 200, (4, 12), generator=torch.Generator().manual_seed(3))


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rows: torch.Tensor):
    """One SFT-like step on `rows` of the batch; (loss, grad norm). Each rank takes its rows and
    the gradients are averaged over ranks, so two ranks' halves make the whole batch's step."""
    out = model(input_ids=rows, labels=rows)
    out.loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    transport.average_gradients(params)  # leaves FSDP's (already averaged) gradients alone
    norm = torch.nn.utils.clip_grad_norm_(params, float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return out.loss.detach(), float(norm)


def _rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    transport.join_process_group(world, "gloo")
    try:
        model = _model(Path(model_dir))
        cluster = SimpleNamespace(sharding="fsdp", fsdp_mixed_precision=None)
        ctx = SimpleNamespace(plan=SimpleNamespace(config=SimpleNamespace(cluster=cluster)))
        ctx.device, ctx.world_size = "cpu", world
        model = sharding.shard_learner(ctx, model)
        assert sharding.is_sharded(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        rows = _batch().chunk(world)[rank]
        loss, norm = _step(model, optimizer, rows)
        full = sharding.gather_full_state(model, optimizer)
        losses = transport.gather_state(loss.item())

        # Scatter the gathered state into a fresh sharded model: the same shards come back.
        fresh = sharding.shard_learner(ctx, _model(Path(model_dir)))
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=LR)
        loader = sharding.ShardedLoader(fresh, fresh_optimizer, reads=rank == 0)
        loader.weights(_all_names(fresh, full.weights) if rank == 0 else {})
        loader.optimizer_state(full.optimizer if rank == 0 else {})
        restored = sharding.gather_full_state(fresh, fresh_optimizer)
        if rank == 0:
            save_file(full.weights, f"{out}/weights.safetensors")
            save_file(restored.weights, f"{out}/restored.safetensors")
            moments = {f"{i}": s["exp_avg"] for i, s in full.optimizer["state"].items()}
            again = {f"{i}": s["exp_avg"] for i, s in restored.optimizer["state"].items()}
            save_file(moments, f"{out}/exp_avg.safetensors")
            save_file(again, f"{out}/exp_avg_restored.safetensors")
            Path(f"{out}/result.json").write_text(
                json.dumps(
                    {"losses": losses, "norm": norm, "groups": full.optimizer["param_groups"]}
                )
            )
    finally:
        transport.leave_process_group()


def _all_names(model: torch.nn.Module, weights: dict) -> dict:
    """`weights` (each tied tensor once) under every name the model has for it."""
    names = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), name)
    return {name: weights[names[id(t)]] for name, t in model.state_dict(keep_vars=True).items()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny("tiny-llama", tmp_path_factory.mktemp("tiny") / "model")


def test_two_sharded_ranks_step_as_one_process(model_dir, tmp_path):
    mp.spawn(_rank, args=(2, _free_port(), str(model_dir), str(tmp_path)), nprocs=2, join=True)
    result = json.loads((tmp_path / "result.json").read_text())

    torch.manual_seed(0)
    model = _model(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loss, norm = _step(model, optimizer, _batch())
    # Equal halves of equal length: the mean of the ranks' mean losses is the batch's.
    assert sum(result["losses"]) / 2 == pytest.approx(loss.item(), rel=1e-5)
    assert result["norm"] == pytest.approx(norm, rel=1e-4)  # the whole gradient's norm

    sharded = load_file(tmp_path / "weights.safetensors")
    expected = dict(model.state_dict())
    assert set(sharded) <= set(expected)
    for name, tensor in sharded.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=1e-6)
    # Indexed as a single process's optimizer numbers its parameters.
    assert [g["params"] for g in result["groups"]] == [
        g["params"] for g in optimizer.state_dict()["param_groups"]
    ]
    restored = load_file(tmp_path / "restored.safetensors")
    assert all(torch.equal(restored[name], sharded[name]) for name in sharded)
    moments = load_file(tmp_path / "exp_avg.safetensors")
    again = load_file(tmp_path / "exp_avg_restored.safetensors")
    assert moments and all(torch.equal(again[name], moments[name]) for name in moments)
    assert any(m.abs().sum() > 0 for m in moments.values())  # a real step's moments


def test_decoder_layers_are_the_blocks_transformers_never_splits(model_dir):
    model = _model(model_dir)
    layers = sharding.decoder_layers(model)
    assert [type(layer).__name__ for layer in layers] == ["LlamaDecoderLayer"] * len(
        model.model.layers
    )
    with pytest.raises(ValueError, match="_no_split_modules"):
        sharding.decoder_layers(torch.nn.Linear(2, 2))
