"""LoRA ([model.lora]) through the real CLI on the tiny models: GRPO, DPO and SFT learn while only
the adapters train, the base model stays bit for bit what it was, a resumed run ends as one
that never stopped, and the merged export is a plain transformers model that computes what the
adapted one does.

Each run takes 20-70 s here (most of it starting Python and torch), so they are marked slow.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout.storage import open_store
from tests.integration.driver import only_run, rollout

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]
peft = pytest.importorskip("peft")


def run(workdir: Path, *args: str) -> None:
    result = rollout(workdir, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def overrides(*settings: str) -> list[str]:
    return [arg for setting in settings for arg in ("--set", setting)]


def series(workdir: Path, name: str) -> list[float]:
    store, record = only_run(workdir)
    return [m.value for m in sorted(store.metrics(record.run_id, [name]), key=lambda m: m.step)]


def last_checkpoint(workdir: Path) -> Path:
    store, record = only_run(workdir)
    return Path(store.checkpoints(record.run_id)[-1].location)


def base_model_dir(workdir: Path, name: str) -> Path:
    return next((workdir / "cache" / "models").glob(f"{name}-*"))


def test_grpo_with_lora_learns_keeps_the_base_and_exports_a_merged_model(workdir):
    run(
        workdir,
        "run",
        "--config",
        "examples/grpo-tiny.toml",
        *overrides(
            "model.lora={ rank = 16, alpha = 32, export = 'merged' }",
            "rewards=[{ fn = './sevens.py:sevens' }]",
            "data.eval=null",
            "data.use_chat_template=false",
            "algorithm.lr=2e-2",
            "algorithm.max_steps=25",
            "algorithm.rollout_batch_size=32",
            "algorithm.num_generations=8",
            "algorithm.minibatch_size=32",
            "generation.max_new_tokens=8",
            "checkpoint.interval=100",
        ),
    )
    rewards = series(workdir, "reward/mean")
    assert len(rewards) == 25
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1, rewards

    checkpoint = last_checkpoint(workdir)
    adapter = load_file(checkpoint / "adapter" / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    # B starts at zero: a B that moved is an adapter that trained.
    assert all(t.abs().max() > 0 for k, t in adapter.items() if ".lora_B." in k)
    # The optimizer stepped the adapters alone: two AdamW moments per adapter tensor.
    moments = load_file(checkpoint / "optimizer.safetensors")
    moment_elements = sum(t.numel() for k, t in moments.items() if k.endswith(("exp_avg", "sq")))
    assert moment_elements == 2 * sum(t.numel() for t in adapter.values())

    from transformers import AutoModelForCausalLM

    base_dir = base_model_dir(workdir, "tiny-llama")
    base = load_file(base_dir / "model.safetensors")
    merged = load_file(checkpoint / "model" / "model.safetensors")
    assert set(merged) == set(base)
    adapted = {k for k in base if k.endswith("_proj.weight")}
    # The base model never moved: what the adapters leave alone is bitwise the base, and what
    # they adapt is the base plus their delta (one rounding of W + BA).
    assert all(torch.equal(merged[k], base[k]) for k in set(base) - adapted)
    assert all(not torch.equal(merged[k], base[k]) for k in adapted)

    # The merged export loads as a plain transformers model and computes what the base model
    # with the adapter (peft's own loader) does.
    plain = AutoModelForCausalLM.from_pretrained(checkpoint / "model")
    with_adapter = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), checkpoint / "adapter"
    )
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        assert torch.allclose(
            plain(input_ids=ids).logits, with_adapter(input_ids=ids).logits, atol=1e-4
        )


def test_lora_run_resumed_mid_way_ends_as_one_that_never_stopped(workdir):
    """With adapter dropout and a KL to the adapters-off reference: the adapter and its
    optimizer state at the last step are bitwise those of an uninterrupted run."""
    plan = workdir / "plan.lock"
    run(
        workdir,
        "plan",
        "--config",
        "examples/grpo-tiny.toml",
        "-o",
        str(plan),
        *overrides(
            "model.lora={ rank = 4, dropout = 0.1 }",
            "algorithm.kl_coef=0.1",
            "algorithm.lr=1e-2",
            "algorithm.max_steps=4",
            "checkpoint.interval=2",
            "data.eval=null",
        ),
    )
    run(workdir, "run", "--plan", str(plan))
    (checkpoints,) = (workdir / "runs").glob("*/checkpoints")
    final = checkpoints / "step-000004"
    assert not (final / "model").exists()  # export = "adapter": the adapter alone
    uninterrupted = {
        name: load_file(final / name)
        for name in ("adapter/adapter_model.safetensors", "optimizer.safetensors")
    }
    assert series(workdir, "train/kl")[-1] > 0  # the reference is not the policy any more

    # As if the run had stopped after step 2 (a finished run is not started again).
    shutil.rmtree(final)
    with open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False) as store:
        (record,) = store.list_runs()
        store.set_status(record.run_id, "stopped")
    run(workdir, "run", "--plan", str(plan))
    for name, expected in uninterrupted.items():
        got = load_file(final / name)
        assert got.keys() == expected.keys()
        differ = [k for k in expected if not torch.equal(got[k], expected[k])]
        assert not differ, (name, differ[:3])


@pytest.mark.parametrize("reference", ["cached", "live"])
def test_dpo_with_lora_starts_at_its_reference_and_learns(workdir, reference):
    run(
        workdir,
        "run",
        "--config",
        "examples/dpo-tiny.toml",
        *overrides("model.lora={}", "algorithm.lr=1e-2", f"algorithm.reference='{reference}'"),
    )
    accuracy = series(workdir, "eval/accuracy")
    margin = series(workdir, "eval/margin")
    # At step 0 the policy (B = 0) is exactly its reference, the base with adapters off.
    assert accuracy[0] == 0.5 and margin[0] == 0.0
    assert accuracy[-1] > 0.8, accuracy
    loss = series(workdir, "train/loss")
    assert sum(loss[-8:]) / 8 < sum(loss[:8]) / 8 - 0.1, loss
    config = json.loads((last_checkpoint(workdir) / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["peft_type"] == "LORA"


def test_sft_with_lora_held_out_loss_falls(workdir):
    run(
        workdir,
        "run",
        "--config",
        "examples/sft-tiny.toml",
        *overrides("model.lora={ target_modules = ['q_proj', 'v_proj', 'down_proj'] }"),
        *overrides("algorithm.lr=1e-2"),
    )
    loss = series(workdir, "eval/loss")
    assert len(loss) == 2
    assert loss[-1] < 0.6 * loss[0], loss
    adapter = load_file(last_checkpoint(workdir) / "adapter" / "adapter_model.safetensors")
    adapted = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in adapter}
    assert adapted == {"q_proj", "v_proj", "down_proj"}
