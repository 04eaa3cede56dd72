"""LoRA ([model.lora]): the config and its rules, what `rollout plan` checks and refuses against
the model, the memory it estimates, and at run time adapters that alone train, a reference that
is the base model without a copy, and checkpoints that hold the adapter exactly."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

from rollout import ConfigError, PlanError
from rollout.config.model import LoraSection
from rollout.planner.builder import build_plan
from rollout.planner.definition import GpuFacts, HardwareFacts
from rollout.planner.lora import adapter_parameters, decoder_linears
from rollout.planner.memory import GIB

H100 = HardwareFacts(
    platform="test",
    cpu_count=8,
    memory_bytes=64 * GIB,
    memory_available_bytes=60 * GIB,
    gpus=[GpuFacts(index=0, name="H100", memory_bytes=80 * GIB)],
)

# SmolLM2-135M's shape: 30 layers, hidden 576, 9 heads of 64, 3 kv heads, MLP 1536, tied.
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


def problems(error: pytest.ExceptionInfo) -> dict[str, str]:
    return {issue.path: f"{issue.message} | {issue.hint}" for issue in error.value.issues}


# --- config and plan checks --------------------------------------------------------------------


def test_an_empty_table_takes_every_default(config_file, base_config):
    base_config["model"]["lora"] = {}
    plan = build_plan(config_file(base_config))
    assert plan.config.model.lora == LoraSection()
    lora = plan.config.model.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules, lora.export) == (
        8,
        16.0,
        0.0,
        "all-linear",
        "adapter",
    )
    # plan.lock records the settings, and what they train.
    assert plan.derived.adapter_parameters == adapter_parameters(lora, plan.model)


@pytest.mark.parametrize(
    ("lora", "path", "words"),
    [
        ({"rank": 0}, "model.lora.rank", "at least 1"),
        ({"dropout": 1.0}, "model.lora.dropout", "less than 1"),
        ({"alpha": 0}, "model.lora.alpha", "greater than 0"),
        ({"export": "full"}, "model.lora.export", "'adapter'"),
        ({"target_modules": "all"}, "model.lora.target_modules", "'all-linear'"),
        ({"target_modules": []}, "model.lora.target_modules", "is empty"),
        ({"target_modules": ["layers.0.q_proj"]}, "model.lora.target_modules[0]", "dotted"),
        ({"target_modules": ["q_proj", "q_proj"]}, "model.lora.target_modules", "more than once"),
        ({"ranks": 8}, "model.lora.ranks", "did you mean 'rank'?"),
    ],
)
def test_settings_out_of_range_are_refused_by_validate(config_file, base_config, lora, path, words):
    base_config["model"]["lora"] = lora
    with pytest.raises(ConfigError) as error:
        build_plan(config_file(base_config))
    found = problems(error)
    assert path in found and words in found[path], found


def test_target_modules_are_checked_against_the_model_with_the_nearest_name(
    config_file, base_config
):
    base_config["model"]["lora"] = {"target_modules": ["q_proj", "v_prj", "lm_head"]}
    with pytest.raises(PlanError) as error:
        build_plan(config_file(base_config))
    found = problems(error)
    assert set(found) == {"model.lora.target_modules[1]", "model.lora.target_modules[2]"}
    assert "no linear layer 'v_prj'" in found["model.lora.target_modules[1]"]
    assert "did you mean 'v_proj'?" in found["model.lora.target_modules[1]"]
    assert "vocabulary head is not adapted" in found["model.lora.target_modules[2]"]


@pytest.mark.parametrize(
    ("change", "path", "words"),
    [
        ({"generation": {"engine": "vllm"}}, "generation.engine", "takes no LoRA adapters"),
        ({"algorithm": {"kind": "rm"}}, "model.lora", "reward models are trained without LoRA"),
    ],
)
def test_combinations_that_cannot_work_are_refused(config_file, base_config, change, path, words):
    config = copy.deepcopy(base_config)
    config["model"]["lora"] = {}
    if change.get("algorithm", {}).get("kind") == "rm":
        config["algorithm"] = {"kind": "rm", "batch_size": 8}
        config["data"]["fields"] = {"prompt": "prompt", "chosen": "answer", "rejected": "answer"}
        del config["generation"], config["rewards"]
    else:
        config["cluster"]["device"] = "cuda"
        config["generation"].update(change["generation"])
    with pytest.raises(ConfigError) as error:
        build_plan(config_file(config))
    found = problems(error)
    assert path in found and words in found[path], found


def test_lora_trains_float32_adapters_so_it_takes_no_master_weights(config_file, base_config):
    """peft keeps adapters in float32 over a bfloat16 base: 'auto' resolves to no master copy,
    and asking for one is refused rather than accepted and run as a float32-over-float32 copy."""
    config = copy.deepcopy(base_config)
    config["model"]["lora"] = {}
    config["model"]["dtype"] = "bfloat16"
    assert build_plan(config_file(config)).derived.precision == "none"
    config["model"]["precision"] = "master_weights"
    with pytest.raises(ConfigError) as error:
        build_plan(config_file(config))
    assert "peft keeps them in float32" in problems(error)["model.precision"]


def test_plan_refuses_lora_without_peft_and_names_the_install(
    config_file, base_config, monkeypatch
):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a)
    )
    base_config["model"]["lora"] = {}
    with pytest.raises(PlanError) as error:
        build_plan(config_file(base_config))
    assert "pip install 'rollout[lora]'" in problems(error)["model.lora"]


def test_adapter_parameters_are_rank_times_in_plus_out_per_adapted_layer(config_file, base_config):
    plan = build_plan(config_file(base_config))
    model = plan.model  # tiny-llama: 2 layers, hidden 64, q/o 64x64, k/v 64->32, MLP 128
    assert decoder_linears(model)["k_proj"] == (64, 32)
    assert adapter_parameters(LoraSection(rank=4, target_modules=["q_proj"]), model) == (
        2 * 4 * (64 + 64)
    )
    every = 2 * 8 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 3)
    assert adapter_parameters(LoraSection(), model) == every


# --- memory ------------------------------------------------------------------------------------


def test_lora_counts_gradients_and_optimizer_of_the_adapters_and_no_reference(
    tmp_path, config_file, base_config
):
    directory = tmp_path / "smollm2-shaped"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(SMOLLM2))
    (directory / "pytorch_model.bin").write_bytes(b"")
    (directory / "tokenizer.json").write_text("{}")
    base_config["model"] = {"path": str(directory)}
    base_config["data"]["use_chat_template"] = False
    base_config["algorithm"]["kl_coef"] = 0.05  # a reference: a copy without LoRA
    base_config["cluster"]["device"] = "cuda"
    full = build_plan(config_file(base_config), hardware=H100)
    base_config["model"]["lora"] = {"rank": 16}
    lora = build_plan(config_file(base_config), hardware=H100)

    (before,), (after,) = full.memory, lora.memory
    params = full.model.num_parameters
    adapters = lora.derived.adapter_parameters
    # 30 layers x 16 x (q 576+576, k 576+192, v 576+192, o 576+576, gate/up 576+1536, down
    # 1536+576): about 3.5% of the model's 134.5M parameters.
    assert adapters == 30 * 16 * (2 * 1152 + 2 * 768 + 3 * 2112)
    assert 0.03 < adapters / params < 0.04
    # bfloat16 on cuda: the model's weights and (without LoRA) gradients take 2 bytes, AdamW's
    # moments 8 and its fp32 master copy 4 (precision "master_weights"); peft keeps adapters in
    # float32: 4, 4 and 8 bytes, and no master copy.
    assert before.items["gradients"] == params * 2
    assert after.items["gradients"] == adapters * 4
    assert before.items["optimizer"] == params * 8
    assert before.items["master_weights"] == params * 4
    assert "master_weights" not in after.items
    assert after.items["optimizer"] == adapters * 8
    assert after.items["adapter_weights"] == adapters * 4
    assert after.items["weights"] == before.items["weights"] == params * 2
    assert before.items["reference_weights"] == params * 2
    assert "reference_weights" not in after.items
    assert not full.derived.reference_adapters_off and lora.derived.reference_adapters_off
    saved = before.total_bytes - after.total_bytes
    assert saved == params * (2 + 2 + 12) - adapters * (4 + 4 + 8)
    print(
        f"\nSmolLM2-shaped GRPO on an H100, kl_coef 0.05: {before.total_bytes / GIB:.2f} GiB "
        f"-> {after.total_bytes / GIB:.2f} GiB with LoRA rank 16 ({adapters / params:.2%})"
    )


# --- run time: adapters, reference, checkpoints --------------------------------------------------


@pytest.fixture
def adapted(tiny_llama):
    """A copy of tiny-llama with LoRA adapters (tiny_llama itself is shared by every test)."""
    pytest.importorskip("peft")
    from rollout.models.lora import add_adapters

    return add_adapters(copy.deepcopy(tiny_llama.model), LoraSection(rank=4))


def _base_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if ".lora_" not in k}


def test_the_optimizer_steps_the_adapters_alone_and_the_base_never_moves(adapted):
    from rollout.config.algorithm import GrpoConfig
    from rollout.runtime.components import build_optimizer

    model = adapted.model
    optimizer = build_optimizer(
        model, GrpoConfig(kind="grpo", lr=1e-2, weight_decay=0.1), precision="none"
    )
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in stepped} == {id(p) for p in adapted.parameters()}
    assert all(".lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    base = _base_weights(model)
    adapters = {n: p.clone() for n, p in model.named_parameters() if p.requires_grad}
    ids = torch.arange(2, 30).reshape(2, -1)
    model.train()
    for _ in range(3):
        optimizer.zero_grad()
        logits = model(input_ids=ids).logits
        torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
        ).backward()
        optimizer.step()
    # Weight decay and all: every base weight is bitwise what it was, every adapter moved.
    assert all(torch.equal(base[k], v) for k, v in _base_weights(model).items())
    assert all(
        not torch.equal(adapters[n], p) for n, p in model.named_parameters() if p.requires_grad
    )


def test_the_reference_is_the_base_model_without_a_copy(adapted, tiny_llama):
    model = adapted.model
    with torch.no_grad():
        for param in adapted.parameters():
            param.add_(0.1)
    reference = adapted.without_adapters()
    assert list(reference.parameters()) == []  # nothing of its own: no second copy
    ids = torch.arange(2, 30).reshape(2, -1)
    model.train()
    with torch.no_grad():
        base = tiny_llama.model(input_ids=ids).logits
        assert torch.equal(reference(input_ids=ids).logits, base)
        assert not torch.allclose(model(input_ids=ids).logits, base)  # adapters on again
    assert model.training  # the policy's mode is its own again


def test_a_checkpoint_holds_the_adapter_exactly_and_the_merged_model_on_request(
    adapted, tiny_llama, tmp_path
):
    from rollout.runtime.checkpoint import load_checkpoint, save_checkpoint

    model = adapted.model
    with torch.no_grad():
        for param in adapted.parameters():
            param.normal_()
    optimizer = torch.optim.AdamW(adapted.parameters())
    common = {
        "tokenizer": tiny_llama.tokenizer,
        "optimizer": optimizer,
        "scheduler": None,
        "trainer_state": {},
        "keep_last": 2,
        "adapters": adapted,
    }
    only = save_checkpoint(tmp_path, 1, model=model, **common)
    merging = replace(adapted, export_merged=True)  # model.lora.export = "merged"
    both = save_checkpoint(tmp_path, 2, model=model, **{**common, "adapters": merging})
    assert not (only / "model").exists() and (both / "model" / "model.safetensors").is_file()
    assert (only / "adapter" / "adapter_model.safetensors").is_file()

    from rollout.models.lora import add_adapters

    fresh = add_adapters(copy.deepcopy(tiny_llama.model), LoraSection(rank=4))
    load_checkpoint(only, model=fresh.model, optimizer=None, scheduler=None, adapters=fresh)
    want = dict(model.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in fresh.model.named_parameters())

    wrong = add_adapters(
        copy.deepcopy(tiny_llama.model), LoraSection(rank=4, target_modules=["q_proj"])
    )
    with pytest.raises(ValueError, match="does not match"):
        load_checkpoint(only, model=wrong.model, optimizer=None, scheduler=None, adapters=wrong)
