"""`rollout checkpoints list / verify / export` as a user meets them, on checkpoints a real save
wrote: states and sizes, exit 2 with the problems for damage, a model transformers loads."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.runtime.checkpoint import save_checkpoint
from rollout.runtime.manifest import MANIFEST
from rollout.storage import open_store
from rollout.storage.base import CheckpointRecord

runner = CliRunner()
RUN = "grpo-tiny-20260101-000000-abc123"


def invoke(*args):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.fixture
def saved(tmp_path: Path, tiny_llama):
    """Three checkpoints of a tiny Llama under a local root, recorded in a SQLite store whose
    run's plan.lock is gone (the root is then found from the store's records)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=tiny_llama.tokenizer.vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    root = tmp_path / "checkpoints"
    location = f"sqlite:{tmp_path / 'rollout.db'}"
    with open_store(location) as store:
        store.create_run(
            RUN,
            name="grpo-tiny",
            plan_sha256="x",
            plan_path=str(tmp_path / "gone.lock"),
            run_dir="",
        )
        for step in (1, 2, 3):
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
            path = save_checkpoint(
                root,
                step,
                model=model,
                tokenizer=tiny_llama.tokenizer,
                optimizer=None,
                scheduler=None,
                trainer_state={},
                keep_last=5,
                run_id=RUN,
            )
            store.add_checkpoint(CheckpointRecord(RUN, step, str(path), time.time()))
    return root, location, model


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_list_shows_each_checkpoint_with_its_state_and_record(saved):
    root, location, _ = saved
    (root / "step-000003" / MANIFEST).unlink()
    result = invoke("checkpoints", "list", RUN, "--store", location, "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["root"] == str(root)
    rows = [(r["step"], r["state"], r["recorded_at"] is not None) for r in report["checkpoints"]]
    assert rows == [(1, "committed", True), (2, "committed", True), (3, "uncommitted", True)]
    assert report["checkpoints"][0]["bytes"] > 0
    text = invoke("checkpoints", "list", RUN, "--store", location)
    assert "committed" in text.output and "uncommitted" in text.output and "KiB" in text.output


def test_list_of_an_unknown_run_is_one_error(saved):
    _, location, _ = saved
    result = invoke("checkpoints", "list", "nope", "--store", location)
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_verify_exits_0_when_good_and_2_with_the_problems(saved):
    root, _, _ = saved
    good = invoke("checkpoints", "verify", str(root))
    assert good.exit_code == 0, good.output
    assert good.output.count("good ") == 3
    flip(root / "step-000002" / "model" / "model.safetensors")
    bad = invoke("checkpoints", "verify", str(root))
    assert bad.exit_code == 2
    assert "damaged  " + str(root / "step-000002") in bad.output
    assert "model/model.safetensors does not match its sha256" in bad.output
    one = invoke("checkpoints", "verify", str(root / "step-000001"))
    assert one.exit_code == 0 and "step-000002" not in one.output
    nothing = invoke("checkpoints", "verify", str(root.parent / "elsewhere"))
    assert nothing.exit_code == 2 and "neither a checkpoint nor" in nothing.output
    assert "Traceback" not in nothing.output


def test_export_writes_a_model_transformers_loads(saved, tmp_path: Path):
    root, location, model = saved
    out = tmp_path / "exported"
    result = invoke("checkpoints", "export", f"{RUN}:2", "--to", str(out), "--store", location)
    assert result.exit_code == 0, result.output
    assert "exported step 2" in result.output
    loaded = AutoModelForCausalLM.from_pretrained(out)
    expected = AutoModelForCausalLM.from_pretrained(root / "step-000002" / "model")
    for name, tensor in expected.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert not torch.equal(  # step 2's weights, not the newest's
        loaded.state_dict()["model.embed_tokens.weight"],
        model.state_dict()["model.embed_tokens.weight"],
    )
    assert (out / "tokenizer.json").is_file() and not (out / MANIFEST).exists()


def test_export_refuses_damage_a_taken_directory_and_an_unknown_step(saved, tmp_path: Path):
    root, location, _ = saved
    flip(root / "step-000003" / "model" / "model.safetensors")
    damaged = invoke("checkpoints", "export", RUN, "--to", str(tmp_path / "a"), "--store", location)
    assert damaged.exit_code == 2 and "does not match its sha256" in damaged.output
    assert "newest good checkpoint is step 2" in damaged.output and not (tmp_path / "a").exists()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    taken = invoke(
        "checkpoints", "export", f"{RUN}:1", "--to", str(tmp_path / "taken"), "--store", location
    )
    assert taken.exit_code == 2 and "not empty" in taken.output
    unknown = invoke(
        "checkpoints", "export", f"{RUN}:9", "--to", str(tmp_path / "b"), "--store", location
    )
    assert unknown.exit_code == 2 and "no checkpoint of step 9" in unknown.output
    for result in (damaged, taken, unknown):
        assert "Traceback" not in result.output
