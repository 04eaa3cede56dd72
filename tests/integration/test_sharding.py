"""cluster.sharding = "fsdp" through the real CLI and torchrun, two CPU ranks on gloo: a sharded
run trains as the replicated data-parallel run of the same plan does (losses, gradient norms and
weights), and its checkpoints resume exactly and export to a directory transformers loads.

Each run takes 15-25 s here (most of it starting Python and torch), so they are marked slow.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout.storage import open_store
from tests.integration.driver import rollout

pytestmark = pytest.mark.slow

STEPS = ["algorithm.max_steps=4", "checkpoint.interval=2", "cluster.nproc_per_node=2"]


def run(workdir: Path, example: str, *overrides: str) -> tuple[Path, dict[str, list[float]]]:
    """Run `example` in a directory of its own under `workdir`; its run directory and metrics."""
    here = workdir / f"run-{len(list(workdir.glob('run-*')))}"
    shutil.copytree(workdir / "examples", here / "examples")
    args = ["run", "--config", f"examples/{example}"]
    for override in (*STEPS, *overrides):
        args += ["--set", override]
    result = rollout(here, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    with open_store(f"sqlite:{here / 'runs' / 'rollout.db'}", create=False) as store:
        (record,) = store.list_runs()
        assert record.status == "finished"
        metrics: dict[str, list[float]] = {}
        for metric in sorted(store.metrics(record.run_id), key=lambda m: m.step):
            metrics.setdefault(metric.name, []).append(metric.value)
    return Path(record.run_dir), metrics


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / "step-000004" / "model" / "model.safetensors")


def test_fsdp_trains_as_replicated_data_parallel(workdir):
    # Two micro batches a step: FSDP accumulates reduced gradients over backward passes.
    accumulate = "algorithm.micro_batch_size=2"
    replicated_dir, replicated = run(workdir, "sft-tiny.toml", accumulate)
    sharded_dir, sharded = run(workdir, "sft-tiny.toml", accumulate, "cluster.sharding=fsdp")
    assert sharded["train/loss"][-1] < sharded["train/loss"][0]  # it learns
    for name in ("train/loss", "train/grad_norm", "eval/loss"):
        assert sharded[name] == pytest.approx(replicated[name], rel=1e-4), name
    ours, theirs = final_weights(sharded_dir), final_weights(replicated_dir)
    assert sorted(ours) == sorted(theirs)  # the same layout: tied tensors once, same names
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5)
    # The optimizer state is saved whole, keyed by parameter index as a replicated run keys it.
    optimizer = "checkpoints/step-000004/optimizer"
    assert json.loads((sharded_dir / f"{optimizer}.json").read_text()) == json.loads(
        (replicated_dir / f"{optimizer}.json").read_text()
    )
    ours, theirs = (
        load_file(d / f"{optimizer}.safetensors") for d in (sharded_dir, replicated_dir)
    )
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-7)


def test_sharded_run_resumes_exactly_and_exports(workdir):
    """DPO with bfloat16 compute over float32 shards and activation checkpointing: resumed from
    step 2 it ends as the run that never stopped; step 4 exports to a plain Hugging Face model."""
    overrides = (
        "cluster.sharding=fsdp",
        "cluster.fsdp_mixed_precision={}",
        "model.gradient_checkpointing=true",
        "data.eval.limit=8",
    )
    run_dir, metrics = run(workdir, "dpo-tiny.toml", *overrides)
    assert metrics["train/loss"][-1] < metrics["train/loss"][0]
    uninterrupted = final_weights(run_dir)
    assert all(t.dtype == torch.float32 for t in uninterrupted.values())  # the shards' dtype

    here = run_dir.parent.parent
    shutil.rmtree(run_dir / "checkpoints" / "step-000004")
    with open_store(f"sqlite:{here / 'runs' / 'rollout.db'}", create=False) as store:
        (record,) = store.list_runs()
        store.set_status(record.run_id, "stopped")
    resumed = rollout(here, "run", "--plan", str(run_dir / "plan.lock"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    weights = final_weights(run_dir)
    differ = [name for name in weights if not torch.equal(weights[name], uninterrupted[name])]
    assert not differ, differ
    with open_store(f"sqlite:{here / 'runs' / 'rollout.db'}", create=False) as store:
        logs = [line.message for line in store.logs(record.run_id, limit=10_000)]
    assert any(m.startswith("resumed from") and "step 2" in m for m in logs), logs

    exported = here / "exported"
    result = rollout(here, "checkpoints", "export", f"{record.run_id}:4", "--to", str(exported))
    assert result.returncode == 0, result.stdout + result.stderr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported)
    loaded = model.state_dict()
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name
