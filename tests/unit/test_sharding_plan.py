"""cluster.sharding at plan time: what is refused and why, the dtypes it resolves to, and the
memory estimate that divides the learner's state over the shards."""

from __future__ import annotations

import pytest

from rollout import PlanError
from rollout.errors import RolloutError
from rollout.planner.builder import build_plan
from rollout.planner.definition import GpuFacts, HardwareFacts

GIB = 1024**3
LAPTOP = HardwareFacts(
    platform="test", cpu_count=8, memory_bytes=16 * GIB, memory_available_bytes=12 * GIB
)
GPU_BOX = LAPTOP.model_copy(
    update={"gpus": [GpuFacts(index=i, name="H100", memory_bytes=80 * GIB) for i in range(2)]}
)


@pytest.fixture
def sft_config(base_config):
    base_config["algorithm"] = {"kind": "sft", "batch_size": 4, "epochs": 1, "max_length": 64}
    base_config["data"]["fields"] = {"prompt": "prompt", "completion": "answer"}
    base_config["rewards"] = []
    del base_config["generation"]
    base_config["cluster"] = {"nproc_per_node": 2, "sharding": "fsdp"}
    return base_config


def issues_of(config_file, config, hardware=LAPTOP) -> dict:
    with pytest.raises(RolloutError) as caught:
        build_plan(config_file(config), hardware=hardware)
    return {issue.path: issue for issue in caught.value.issues}


def test_sharded_sft_plans_float32_shards_and_no_master_copies(config_file, sft_config):
    sft_config["cluster"]["fsdp_mixed_precision"] = {}
    plan = build_plan(config_file(sft_config), hardware=GPU_BOX)
    # On GPUs "auto" would be bfloat16 weights with float32 copies; FSDP's float32 shards are
    # the master copy, and the layers compute in bfloat16.
    assert plan.derived.dtype == "float32" and plan.derived.precision == "none"
    mixed = plan.config.cluster.fsdp_mixed_precision
    assert (mixed.param_dtype, mixed.reduce_dtype) == ("bfloat16", "float32")


def test_memory_estimate_divides_the_learner_state_over_the_shards(config_file, sft_config):
    sft_config["model"]["dtype"] = "float32"  # the same weights both ways
    sharded = build_plan(config_file(sft_config), hardware=GPU_BOX).memory
    sft_config["cluster"]["sharding"] = "none"
    replicated = build_plan(config_file(sft_config), hardware=GPU_BOX).memory
    assert [m.device for m in sharded] == ["cuda:0", "cuda:1"]
    for ours, theirs in zip(sharded, replicated, strict=True):
        for item in ("weights", "gradients", "optimizer"):
            assert ours.items[item] == pytest.approx(theirs.items[item] / 2, abs=1), item
        assert "unsharded_layers" in ours.items and "unsharded_layers" not in theirs.items


def test_online_kinds_are_refused_colocated(config_file, base_config):
    base_config["cluster"] = {"nproc_per_node": 2, "sharding": "fsdp"}
    issue = issues_of(config_file, base_config)["cluster.sharding"]
    assert "colocated" in issue.message and "decode steps" in issue.message
    assert issue.hint and "ranks of their own" in issue.hint and "learner = [1, 2]" in issue.hint


def _split(base_config, learners: list[int]) -> None:
    base_config["cluster"] = {
        "nproc_per_node": 1 + len(learners),
        "sharding": "fsdp",
        "placement": {"actor": [0], "learner": learners},
    }


def test_online_kinds_shard_learners_on_ranks_of_their_own(config_file, base_config):
    _split(base_config, [1, 2])
    plan = build_plan(config_file(base_config), hardware=LAPTOP)
    learners = [m for m in plan.memory if m.device == "cpu" and "unsharded_layers" in m.items]
    assert plan.config.cluster.sharding == "fsdp" and learners


def test_online_kinds_with_one_learner_are_refused(config_file, base_config):
    _split(base_config, [1])
    issue = issues_of(config_file, base_config)["cluster.sharding"]
    assert "nothing to shard" in issue.message and "learner = [1, 2]" in issue.hint


def test_ppo_is_refused(config_file, base_config):
    _split(base_config, [1, 2])
    base_config["algorithm"]["kind"] = "ppo"
    issue = issues_of(config_file, base_config)["cluster.sharding"]
    assert "critic" in issue.message


def test_reward_models_are_refused(config_file, sft_config, tmp_path):
    (tmp_path / "prefs.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n' * 8)
    sft_config["algorithm"] = {"kind": "rm", "batch_size": 4, "epochs": 1, "max_length": 64}
    fields = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    sft_config["data"] = {"train": {"path": "prefs.jsonl"}, "fields": fields}
    found = issues_of(config_file, sft_config)
    issue = found["cluster.sharding"]
    assert "score head" in issue.message


def test_lora_is_refused(config_file, sft_config):
    sft_config["model"]["lora"] = {}
    issue = issues_of(config_file, sft_config)["cluster.sharding"]
    assert "LoRA" in issue.message


def test_one_process_is_refused(config_file, sft_config):
    sft_config["cluster"]["nproc_per_node"] = 1
    issue = issues_of(config_file, sft_config)["cluster.sharding"]
    assert "nothing to shard" in issue.message and "nproc_per_node" in issue.hint


def test_master_weights_is_refused(config_file, sft_config):
    sft_config["model"].update(precision="master_weights", dtype="bfloat16")
    issue = issues_of(config_file, sft_config)["model.precision"]
    assert "fsdp_mixed_precision" in issue.hint


def test_mixed_precision_without_sharding_is_refused(config_file, sft_config):
    sft_config["cluster"].update(sharding="none", fsdp_mixed_precision={})
    issue = issues_of(config_file, sft_config)["cluster.fsdp_mixed_precision"]
    assert "sharding" in issue.hint


def test_plan_error_is_what_plan_raises(config_file, sft_config):
    sft_config["model"]["lora"] = {}
    with pytest.raises(PlanError):
        build_plan(config_file(sft_config), hardware=LAPTOP)
