"""Plan-time generation memory: the KV cache and the hf engine's packed weights, counted by hand,
the refusal of a batch that cannot fit (with its numbers and knobs), and what --explain shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from rollout import PlanError
from rollout.config.model import ModelSection
from rollout.planner import runnable
from rollout.planner.builder import build_plan
from rollout.planner.definition import GpuFacts, HardwareFacts
from rollout.planner.explain import explain
from rollout.planner.inspect_model import inspect_model
from rollout.planner.memory import (
    GIB,
    generation_shape,
    kv_bytes_per_token,
    packed_weight_bytes,
    vllm_kv_room,
    vllm_share_issues,
)
from tests.unit.conftest import offline_config

LAPTOP = HardwareFacts(
    platform="test", cpu_count=8, memory_bytes=16 * GIB, memory_available_bytes=12 * GIB
)
TWO_H100 = LAPTOP.model_copy(
    update={"gpus": [GpuFacts(index=i, name="H100", memory_bytes=80 * GIB) for i in range(2)]}
)

# tiny-llama (rollout.models.builtin): 2 layers, hidden 64, 4 heads of 16, 2 kv heads, MLP 128,
# vocab 512, tied embeddings.
TINY_KV_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # keys and values x layers x kv heads x head_dim x fp32
TINY_LINEAR = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128)  # q, k, v, o, gate, up, down
TINY_HEAD = 512 * 64

# Llama-3.2-1B's shape: 16 layers, hidden 2048, 32 heads of 64, 8 kv heads, MLP 8192.
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
}


def plan_of(config_file, config, hardware=LAPTOP):
    return build_plan(config_file(config), hardware=hardware)


def test_kv_cache_is_batch_times_context_times_bytes_per_token(config_file, base_config):
    # base: rollout batch 8 (one actor process), 32 prompt + 8 new tokens, float32
    items = plan_of(config_file, base_config).memory[0].items
    assert TINY_KV_PER_TOKEN == 512
    assert items["kv_cache"] == 8 * (32 + 8) * 512 == 163_840
    assert items["sampling"] == 8 * 512 * 4 * 3  # logits, weights, running sum: fp32 [8, 512]
    assert "packed_weights" not in items  # 8 new tokens: too short for the engine to pack


def test_max_batch_size_caps_the_kv_cache_and_long_generations_pack_the_weights(
    config_file, base_config
):
    base_config["generation"].update(max_batch_size=4, max_new_tokens=16)
    items = plan_of(config_file, base_config).memory[0].items
    assert items["kv_cache"] == 4 * (32 + 16) * 512 == 98_304
    # The packed copy: every decoder linear weight and the head (tied, but packed all the same).
    assert items["packed_weights"] == (TINY_LINEAR + TINY_HEAD) * 4 == 425_984


def test_evaluation_batch_counts_when_it_is_the_larger(config_file, base_config, tmp_path):
    (tmp_path / "eval.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(20))
    )
    base_config["data"]["eval"] = {"path": "eval.jsonl"}
    plan = plan_of(config_file, base_config)
    shape = generation_shape(plan.config, plan.model, plan.graph, plan.derived, plan.data)
    assert shape.batch == 20 and "20 eval prompts" in shape.batch_reason
    assert plan.memory[0].items["kv_cache"] == 20 * 40 * 512


def test_no_packing_outside_float32_on_cpu(config_file, base_config):
    plan = plan_of(config_file, base_config)
    model = plan.model
    assert packed_weight_bytes(model, "float32", "cpu", 16) == (TINY_LINEAR + TINY_HEAD) * 4
    assert packed_weight_bytes(model, "bfloat16", "cpu", 16) == 0
    assert packed_weight_bytes(model, "float32", "cuda", 16) == 0
    assert packed_weight_bytes(model, "float32", "cpu", 15) == 0


@pytest.fixture
def llama_1b(tmp_path):
    """A Llama-3.2-1B-shaped model directory: config.json and (empty) weight and tokenizer files,
    which is all planning reads."""
    directory = tmp_path / "llama-1b"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA_1B))
    (directory / "pytorch_model.bin").write_bytes(b"")
    (directory / "tokenizer.json").write_text("{}")
    return directory


@pytest.fixture(autouse=True)
def split_placements_run(monkeypatch):
    """These tests size memory for an actor on its own GPU, a placement this version refuses to
    run (rollout.planner.runnable): lift that one refusal so the estimate is what they see."""
    from rollout.planner import builder

    def refusals(config, graph=None):
        return [i for i in runnable.run_refusals(config, graph) if i.path != "cluster.placement"]

    monkeypatch.setattr(builder, "run_refusals", refusals)


def actor_on_its_own_gpu(base_config, llama_1b, **generation):
    base_config["model"] = {"path": str(llama_1b), "gradient_checkpointing": True}
    base_config["data"]["use_chat_template"] = False  # the stand-in model ships no template
    base_config["algorithm"].update(rollout_batch_size=512, micro_batch_size=1)
    base_config["generation"] = {"max_prompt_tokens": 4096, "max_new_tokens": 4096, **generation}
    base_config["cluster"] = {
        "device": "cuda",
        "nproc_per_node": 2,
        "placement": {"actor": [0], "learner": [1]},
    }
    return base_config


def test_a_kv_cache_too_large_for_the_gpu_fails_the_plan_with_its_numbers(
    config_file, base_config, llama_1b
):
    config = actor_on_its_own_gpu(base_config, llama_1b)
    with pytest.raises(PlanError) as caught:
        plan_of(config_file, config, TWO_H100)
    (issue,) = caught.value.issues
    # 2 x 16 layers x 8 kv heads x 64 x 2 bytes (bfloat16 on GPU) = 32 KiB per token;
    # 512 sequences x 8192 tokens of it = 128 GiB, on an 80 GiB GPU.
    assert issue.path == "cluster"
    assert "on cuda:0" in issue.message and "largest items: kv_cache 128.00 GiB" in issue.message
    assert "512 sequences" in issue.message and "8192 tokens" in issue.message
    assert "32768 bytes per token" in issue.message
    for knob in ("max_batch_size", "max_new_tokens", "max_prompt_tokens"):
        assert f"generation.{knob}" in issue.hint
    assert "now 512, 4096 and 4096" in issue.hint


def test_lowering_max_batch_size_makes_it_fit(config_file, base_config, llama_1b):
    config = actor_on_its_own_gpu(base_config, llama_1b, max_batch_size=64)
    plan = plan_of(config_file, config, TWO_H100)
    actor_gpu = {m.device: m for m in plan.memory}["cuda:0"]
    assert actor_gpu.items["kv_cache"] == 64 * 8192 * 32768 == 16 * GIB
    assert actor_gpu.fits


def test_a_gpu_busy_with_another_process_counts_only_its_free_memory(
    config_file, base_config, llama_1b
):
    """The plan that fits an idle 80 GiB GPU fails on one where another process holds 70 GiB,
    and says how much was free."""
    config = actor_on_its_own_gpu(base_config, llama_1b, max_batch_size=64)
    busy = TWO_H100.model_copy(
        update={
            "gpus": [
                gpu.model_copy(update={"memory_free_bytes": 10 * GIB}) for gpu in TWO_H100.gpus
            ]
        }
    )
    with pytest.raises(PlanError) as caught:
        plan_of(config_file, config, busy)
    issue = next(i for i in caught.value.issues if "on cuda:0" in i.message)
    assert "95% of 10.00 GiB free" in issue.message
    assert plan_of(config_file, config, TWO_H100).memory[0].fits


def test_vllm_share_must_hold_the_weights_and_one_full_sequence(config_file, base_config, llama_1b):
    config = actor_on_its_own_gpu(base_config, llama_1b, max_batch_size=64)
    plan = plan_of(config_file, config, TWO_H100)
    # The same plan for vllm (which is not installed here, so planning it for real stops at
    # that): the share rule is a pure function of the plan's facts.
    gen = plan.config.generation.model_copy(
        update={"engine": "vllm", "gpu_memory_utilization": 0.04}
    )
    config = plan.config.model_copy(update={"generation": gen})
    shape = generation_shape(config, plan.model, plan.graph, plan.derived, plan.data)
    room = vllm_kv_room(config, plan.model, plan.derived, TWO_H100, plan.graph, shape)
    weights = plan.model.num_parameters * 2  # bfloat16
    per_sequence = 8192 * 32768  # 256 MiB
    assert room.share_bytes == int(80 * GIB * 0.04)
    assert room.sequences == (room.share_bytes - weights) // per_sequence >= 1
    assert vllm_share_issues(config, plan.model, plan.derived, TWO_H100, plan.graph, shape) == []

    small = config.model_copy(
        update={"generation": gen.model_copy(update={"gpu_memory_utilization": 0.03})}
    )
    (issue,) = vllm_share_issues(small, plan.model, plan.derived, TWO_H100, plan.graph, shape)
    assert issue.path == "generation.gpu_memory_utilization"
    assert "one 8192-token sequence" in issue.message


def test_kv_bytes_per_token_matches_what_the_model_caches(tiny_llama):
    """The formula against transformers' own cache after a forward of 3 x 5 tokens."""
    import torch
    from transformers import DynamicCache

    from rollout.engines.base import cache_keyword

    facts = inspect_model(ModelSection(builtin="tiny-llama"), base_dir=Path.cwd())
    cache = DynamicCache(config=tiny_llama.model.config)
    with torch.no_grad():
        tiny_llama.model(
            input_ids=torch.ones(3, 5, dtype=torch.long), **{cache_keyword(tiny_llama.model): cache}
        )
    cached = sum(
        layer.keys.numel() * layer.keys.element_size()
        + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
    )
    assert cached == 3 * 5 * kv_bytes_per_token(facts, 4)


def test_packed_weight_rule_mirrors_the_hf_engine(tiny_llama):
    """The planner's copy of the engine's packing rule: same constants, same bytes."""
    from rollout.engines.hf import packing
    from rollout.planner import memory

    assert memory.PACK_MIN_NEW_TOKENS == packing.PACK_MIN_NEW_TOKENS
    assert memory.PACK_MAX_BYTES == packing.PACK_MAX_BYTES
    model = tiny_llama.model
    packed = [
        getattr(getattr(layer, part), name).weight
        for layer in model.model.layers
        for part, names in (
            ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
            ("mlp", ("gate_proj", "up_proj", "down_proj")),
        )
        for name in names
    ] + [model.lm_head.weight]
    facts = inspect_model(ModelSection(builtin="tiny-llama"), base_dir=Path.cwd())
    expected = sum(w.numel() * w.element_size() for w in packed)
    assert packed_weight_bytes(facts, "float32", "cpu", 16) == expected
    for new_tokens in (8, 16):
        planned = packed_weight_bytes(facts, "float32", "cpu", new_tokens) > 0
        assert planned == packing.should_pack(model, new_tokens)


def test_explain_shows_the_engine_batch_kv_cache_and_memory(config_file, base_config):
    base_config["generation"].update(max_batch_size=4, max_new_tokens=16)
    console = Console(width=200, record=True)
    explain(plan_of(config_file, base_config), console)
    text = console.export_text()
    assert "hf: 4 sequences at once per actor process" in text
    assert "generation.max_batch_size 4" in text
    assert "context 48 tokens (32 prompt + 16 new)" in text
    assert (
        "4 sequences x 48 tokens x 512 bytes (2 x 2 layers x 2 kv heads x 16 head dim x 4" in text
    )
    assert "packed" in text and "0.4 MiB" in text
    for line in ("kv cache", "packed weights", "sampling", "total", "capacity", "fits"):
        assert line in text


def test_explain_draws_each_roles_ranks_and_devices(config_file, base_config):
    """A disaggregated plan on two GPUs: the actor on cuda:0, the learner on cuda:1, and the
    edges between them through torch.distributed."""
    base_config["cluster"] = {
        "device": "cuda",
        "nproc_per_node": 2,
        "placement": {"actor": [0], "learner": [1]},
    }
    base_config.get("data", {}).pop("eval", None)
    console = Console(width=200, record=True)
    explain(plan_of(config_file, base_config, TWO_H100), console)
    rows = {line.split("│")[1].strip(): line for line in console.export_text().splitlines()
            if line.count("│") >= 4}  # fmt: skip
    assert "│ 0 " in rows["actor"] and "cuda:0" in rows["actor"]
    assert "│ 1 " in rows["learner"] and "cuda:1" in rows["learner"]
    assert "cuda:0" not in rows["learner"]
    assert (
        "torch distributed" in rows["learner -> actor"]
        and "weight sync" in rows["learner -> actor"]
    )


def test_vllm_plan_fails_clearly_without_cuda_or_the_package(config_file, base_config):
    import importlib.util

    installed = importlib.util.find_spec("vllm") is not None
    base_config["generation"]["engine"] = "vllm"
    base_config["cluster"] = {"device": "auto"}
    for hardware, needs_gpu in ((LAPTOP, True), (TWO_H100, False)):
        if installed and not needs_gpu:
            continue  # a GPU machine with vllm: nothing to refuse
        with pytest.raises(PlanError) as caught:
            plan_of(config_file, base_config, hardware)
        found = [i for i in caught.value.issues if i.path == "generation.engine"]
        messages = " ".join(i.message for i in found)
        hints = " ".join(i.hint or "" for i in found)
        assert ("needs a CUDA GPU" in messages) == needs_gpu
        assert ("not installed" in messages) == (not installed)
        if not installed:
            assert "pip install 'rollout[vllm]'" in hints
        if needs_gpu:
            assert 'engine = "hf"' in hints and "this plan runs on cpu" in messages


# tiny-llama's parameters: embeddings 512 x 64 (the head is tied to them), 2 layers of
# 64 x (64 + 2 x 32) + 64 x 64 attention, 3 x 64 x 128 MLP and 2 x 64 norms, a final norm of 64.
TINY_PARAMS = 512 * 64 + 2 * (64 * 128 + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64


@pytest.mark.parametrize(
    ("kind", "settings", "reference_bytes"),
    [
        ("dpo", {}, 0),  # reference = "cached", the default
        ("ipo", {"reference": "cached"}, 0),
        ("kto", {}, 0),
        ("dpo", {"reference": "live"}, 4 * TINY_PARAMS),
        ("kto", {"reference": "live"}, 4 * TINY_PARAMS),
        ("sft", {}, 0),
        ("rm", {}, 0),
    ],
)
def test_offline_kinds_count_a_reference_model_only_when_it_stays_loaded(
    tmp_path, kind, settings, reference_bytes
):
    plan = build_plan(offline_config(tmp_path, kind, **settings), hardware=LAPTOP)
    assert plan.model.num_parameters == TINY_PARAMS == 106_816
    (estimate,) = plan.memory
    items = estimate.items
    assert items.get("reference_weights", 0) == reference_bytes
    # float32 weights and gradients, AdamW's two float32 moments, the runtime's allowance.
    assert items["weights"] == items["gradients"] == 4 * TINY_PARAMS == 427_264
    assert items["optimizer"] == 8 * TINY_PARAMS
    expected = 16 * TINY_PARAMS + reference_bytes + items["activations"] + GIB
    assert estimate.total_bytes == expected


@pytest.mark.parametrize(("kl_coef", "reference_bytes"), [(0.0, 0), (0.05, 4 * TINY_PARAMS)])
def test_online_kinds_count_the_reference_model_of_their_kl_term(
    config_file, base_config, kl_coef, reference_bytes
):
    base_config["algorithm"]["kl_coef"] = kl_coef
    items = plan_of(config_file, base_config).memory[0].items
    assert items.get("reference_weights", 0) == reference_bytes


def test_explain_says_where_the_reference_comes_from(tmp_path):
    def shown(**settings) -> str:
        console = Console(width=200, record=True)
        explain(build_plan(offline_config(tmp_path, "dpo", **settings), hardware=LAPTOP), console)
        return console.export_text()

    cached = shown()
    assert "reference weights" not in cached
    assert "computed once before step 1 by the policy itself" in cached
    assert "no reference model is held" in cached
    live = shown(reference="live")
    assert "reference weights" in live and "0.4 MiB" in live  # 4 x 106_816 bytes
    assert "a frozen copy of the initial policy, loaded through training" in live
