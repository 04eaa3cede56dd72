"""The tiny model on a CUDA GPU, in bfloat16 and float32: every online kind (GRPO, RLOO,
REINFORCE++, PPO) and offline kind (DPO, IPO, KTO, SFT, RM) trains a couple of steps through
`rollout run`; `rollout generate` and `rollout serve` answer; a killed GRPO run resumes; and the
engine's log-probs match the learner's recomputation on the GPU.

Skipped where torch sees no GPU (conftest.py). On the CPU, tests/unit/test_devices.py catches the
usual cause of a CUDA-only failure: a tensor made without a device.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rollout.planner.lockfile import read_plan
from tests.integration.driver import environment, only_run, processes_mentioning, rollout

DTYPES = ["bfloat16", "float32"]
ONLINE = ["grpo", "rloo", "reinforce-pp", "ppo"]
OFFLINE = ["dpo", "ipo", "kto", "sft", "rm"]
EXAMPLE = {"grpo": "grpo-tiny.toml", "rloo": "grpo-tiny.toml"}
"""Kinds without an example of their own run GRPO's with algorithm.kind changed."""

ON_CUDA = ["--set", 'cluster.device="cuda"', "--set", "checkpoint.interval=100"]


def _plan_and_run(workdir: Path, example: str, *overrides: str) -> tuple[object, str]:
    """Plan `example` on the GPU, check the plan says so, run it; (the plan, the run id)."""
    plan = workdir / "plan.lock"
    sets = [arg for override in overrides for arg in ("--set", override)]
    planned = rollout(
        workdir, "plan", "--config", f"examples/{example}", "-o", str(plan), *ON_CUDA, *sets
    )
    assert planned.returncode == 0, planned.stdout + planned.stderr
    frozen = read_plan(plan)
    assert frozen.graph.device.startswith("cuda"), frozen.graph.device
    assert frozen.graph.backend == "nccl"
    ran = rollout(workdir, "run", "--plan", str(plan), timeout=600)
    output = ran.stdout + ran.stderr
    assert ran.returncode == 0, output
    assert "Traceback" not in output
    _, record = only_run(workdir)
    assert record.status == "finished", output
    return frozen, record.run_id


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ONLINE)
def test_online_kinds_train_on_cuda(workdir, kind, dtype):
    example = EXAMPLE.get(kind, f"{kind}-tiny.toml")
    algorithm = kind.replace("-", "_")
    frozen, run_id = _plan_and_run(
        workdir,
        example,
        f'algorithm.kind="{algorithm}"',
        f'model.dtype="{dtype}"',
        "algorithm.max_steps=2",
        "data.eval=null",
    )
    assert frozen.derived.dtype == dtype
    store, record = only_run(workdir)
    assert record.last_step == 2
    assert sorted({m.step for m in store.metrics(run_id, ["reward/mean"])}) == [1, 2]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", OFFLINE)
def test_offline_kinds_train_on_cuda(workdir, kind, dtype):
    frozen, _ = _plan_and_run(
        workdir, f"{kind}-tiny.toml", f'model.dtype="{dtype}"', "algorithm.max_steps=2"
    )
    assert frozen.derived.dtype == dtype
    _, record = only_run(workdir)
    assert record.last_step == 2


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_generate_on_cuda(workdir, device):
    """`--device auto` is what a user gets by default: on a GPU machine it is the GPU."""
    prompts = workdir / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?"}) + "\n" for i in range(6))
    )
    result = rollout(
        workdir, "generate", "--prompts", str(prompts), "--out", "out.jsonl",
        "--model", "tiny-llama", "--max-new-tokens", "8", "--n", "2", "--logprobs",
        "--device", device,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in (workdir / "out.jsonl").read_text().splitlines()]
    assert len(records) == 12
    assert all(len(r["logprobs"]) == r["completion_tokens"] > 0 for r in records)


@pytest.mark.parametrize("dtype", DTYPES)
def test_serve_answers_a_completion_on_cuda(workdir, dtype):
    import openai

    process = subprocess.Popen(
        [
            sys.executable, "-m", "rollout", "serve", "--model", "builtin:tiny-llama",
            "--port", "0", "--device", "cuda", "--dtype", dtype,
        ],
        cwd=workdir, env=environment(workdir), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        line = ""
        while "serving" not in line:
            line = process.stdout.readline()
            assert line, "the server exited before serving"
        url = line.split(" at ")[1].split()[0]
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        response = client.completions.create(
            model="tiny-llama", prompt="The capital of France is", max_tokens=8, logprobs=1
        )
        (choice,) = response.choices
        assert len(choice.model_extra["rollout"]["token_ids"]) >= 1
        assert response.usage.completion_tokens == len(choice.logprobs.token_logprobs)
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_a_killed_grpo_run_resumes_on_cuda(workdir):
    plan = workdir / "plan.lock"
    planned = rollout(
        workdir, "plan", "--config", "examples/grpo-tiny.toml", "-o", str(plan), *ON_CUDA,
        "--set", "algorithm.max_steps=12", "--set", "checkpoint.interval=2",
        "--set", "data.eval=null",
    )  # fmt: skip
    assert planned.returncode == 0, planned.stdout + planned.stderr
    host = subprocess.Popen(
        [sys.executable, "-m", "rollout", "run", "--plan", str(plan)],
        cwd=workdir, env=environment(workdir),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not list((workdir / "runs").glob("*/checkpoints/step-000002/manifest.json")):
        assert host.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no checkpoint at step 2 within 300 s"
        time.sleep(0.05)
    for pid in processes_mentioning(str(workdir)):  # SIGKILL: no handler runs, as in a crash
        os.kill(pid, signal.SIGKILL)
    host.wait(timeout=60)

    resumed = rollout(workdir, "run", "--plan", str(plan), timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    store, record = only_run(workdir)
    assert record.status == "finished" and record.last_step == 12
    messages = [line.message for line in store.logs(record.run_id, limit=10_000)]
    assert any(m.startswith("resumed from") for m in messages), messages


LOGPROB_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}
"""Max abs difference between the engine's and the learner's log-probs. float32 as on the CPU
(tests/unit/test_hf_engine.py: cached decoding and a full forward add the same products in
another order); bfloat16 keeps 8 bits of mantissa, so the two orders differ by far more."""


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_logprobs_match_the_learners_on_cuda(rollout_cache, dtype):
    from rollout.algorithms.losses import token_logprobs
    from rollout.config.model import ModelSection
    from rollout.engines.base import SamplingParams
    from rollout.engines.hf.engine import HfEngine
    from rollout.models.loading import apply_chat_template, load_model
    from rollout.planner.inspect_model import inspect_model
    from rollout.runtime.online.batches import RolloutBatch, pad_for_learner
    from rollout.runtime.online.shared_prefix import shared_prefix_logprobs

    section = ModelSection(builtin="tiny-llama")
    facts = inspect_model(section, base_dir=Path.cwd())
    loaded = load_model(facts, section, dtype=dtype, device="cuda")
    engine = HfEngine(
        loaded.model,
        eos_token_ids=loaded.eos_token_ids,
        pad_token_id=loaded.pad_token_id,
        tokenizer=loaded.tokenizer,
        device="cuda",
        seed=0,
    )
    system = "You are a careful assistant: answer in one line."  # a shared prefix
    prompts = [
        apply_chat_template(loaded.tokenizer, loaded.chat_template, q, system)
        for q in ("What is 2 + 3?", "Hi", "Compute 12 * 7 - 7, then explain.")
    ]
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=12, n=2, seed=1))
    batch = RolloutBatch(
        prompt_ids=[prompts[c.prompt_index] for c in completions],
        completion_ids=[c.token_ids for c in completions],
        old_logprobs=[c.logprobs for c in completions],
        rewards=torch.zeros(len(completions), device="cpu"),
        advantages=torch.zeros(len(completions), device="cpu"),
        group_size=2,
        policy_version=0,
    )
    padded = pad_for_learner(batch, loaded.pad_token_id, "cuda")
    with torch.no_grad():
        shared = shared_prefix_logprobs(
            loaded.model, batch, pad_token_id=loaded.pad_token_id, device="cuda", temperature=1.0
        )
        logits = loaded.model(
            input_ids=padded.input_ids,
            attention_mask=padded.attention_mask,
            position_ids=padded.position_ids,
            logits_to_keep=padded.logits_to_keep,
        ).logits[:, :-1]
    plain = token_logprobs(logits.float(), padded.targets)
    engine_logprobs = padded.old_logprobs
    mask = padded.completion_mask
    for learner in (shared, plain):
        assert learner.device.type == "cuda"
        worst = ((learner.float() - engine_logprobs).abs() * mask).max().item()
        assert worst < LOGPROB_TOLERANCE[dtype], worst


@pytest.mark.parametrize("export", ["adapter", "merged"])
def test_a_lora_grpo_run_trains_its_adapters_on_cuda(workdir, export):
    """LoRA in bfloat16 on the GPU: a GRPO run with a KL to the adapters-off reference trains
    the adapters (B moves off zero) and checkpoints them, with the merged model on request."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    frozen, run_id = _plan_and_run(
        workdir,
        "grpo-lora-tiny.toml",
        'model.dtype="bfloat16"',
        f'model.lora.export="{export}"',
        "algorithm.max_steps=2",
        "algorithm.lr=1e-2",
        "data.eval=null",
    )
    assert frozen.derived.reference_adapters_off and frozen.derived.adapter_parameters
    (item,) = [e.items for e in frozen.memory if e.device.startswith("cuda")]
    assert "reference_weights" not in item and item["adapter_weights"] > 0
    store, record = only_run(workdir)
    assert record.last_step == 2
    assert sorted({m.step for m in store.metrics(run_id, ["train/kl"])}) == [1, 2]
    checkpoint = Path(store.checkpoints(run_id)[-1].location)
    adapter = load_file(checkpoint / "adapter" / "adapter_model.safetensors")
    assert all(t.dtype == torch.float32 for t in adapter.values())  # peft keeps them float32
    assert any(t.abs().max() > 0 for k, t in adapter.items() if ".lora_B." in k)
    assert (checkpoint / "model").is_dir() == (export == "merged")
