"""`rollout checkpoints export` of a LoRA run that saved its adapter only (model.lora.export =
"adapter"): the base model from the run's plan with the adapter merged in, loadable by
transformers alone, computing what peft computes with the adapter attached."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.driver import only_run, rollout

pytestmark = pytest.mark.slow


def test_an_adapter_only_checkpoint_exports_as_the_merged_model(workdir):
    result = rollout(
        workdir,
        "run",
        "--config",
        "examples/grpo-lora-tiny.toml",
        *("--set", "model.lora.export='adapter'", "--set", "model.lora.dropout=0.0"),
        *("--set", "algorithm.max_steps=2", "--set", "algorithm.lr=5e-3"),
        *("--set", "data.eval=null"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    _, record = only_run(workdir)
    checkpoint = Path(record.run_dir) / "checkpoints" / "step-000002"
    assert (checkpoint / "adapter").is_dir() and not (checkpoint / "model").exists()

    out = workdir / "merged"
    exported = rollout(workdir, "checkpoints", "export", record.run_id, "--to", str(out))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert "merging the LoRA adapter" in exported.stderr

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out)
    base_dir = next((workdir / "cache" / "models").glob("tiny-llama-*"))
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    adapted = PeftModel.from_pretrained(base, checkpoint / "adapter")
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base_dir)(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert not torch.allclose(got, plain, atol=1e-4)  # the adapter changed something
