"""The plan builder: derived values, the actor/learner graph, memory, and plan-time refusals."""

from __future__ import annotations

import json

import pytest

from rollout import PlanError
from rollout.planner.builder import build_plan
from rollout.planner.definition import GpuFacts, HardwareFacts
from rollout.seeds import derive_seed

GIB = 1024**3
LAPTOP = HardwareFacts(
    platform="test", cpu_count=8, memory_bytes=16 * GIB, memory_available_bytes=12 * GIB
)
TINY_BOX = LAPTOP.model_copy(update={"memory_bytes": GIB // 2})
GPU_BOX = LAPTOP.model_copy(
    update={"gpus": [GpuFacts(index=i, name="H100", memory_bytes=80 * GIB) for i in range(2)]}
)


def plan_of(config_file, config, hardware=LAPTOP, **kwargs):
    return build_plan(config_file(config), hardware=hardware, **kwargs)


def issues_of(config_file, config, hardware=LAPTOP) -> dict:
    with pytest.raises(PlanError) as caught:
        plan_of(config_file, config, hardware)
    return {issue.path: issue for issue in caught.value.issues}


def test_derived_batch_arithmetic(config_file, base_config):
    base_config["algorithm"].update(rollout_batch_size=16, minibatch_size=8, update_epochs=2)
    plan = plan_of(config_file, base_config)
    derived = plan.derived
    assert derived.prompts_per_step == 4
    assert derived.minibatch_size == 8 and derived.micro_batch_size == 8
    assert derived.optimizer_steps_per_step == 4  # 16 / 8 minibatches x 2 epochs
    assert derived.max_sequence_length == 32 + 8
    assert derived.dtype == "float32"
    assert derived.threads_per_process == 8
    assert plan.run_id.startswith("t-")


def test_offline_total_steps_come_from_the_data(config_file, base_config):
    base_config["algorithm"] = {"kind": "sft", "batch_size": 4, "epochs": 3, "max_length": 64}
    base_config["data"]["fields"] = {"prompt": "prompt", "completion": "answer"}
    base_config["rewards"] = []
    del base_config["generation"]  # sft generates nothing
    plan = plan_of(config_file, base_config)
    assert plan.derived.total_steps == 16 // 4 * 3
    assert [r.role for r in plan.graph.roles] == ["learner"]


def test_colocated_grpo_graph_keeps_edges_in_process(config_file, base_config):
    graph = plan_of(config_file, base_config).graph
    assert [r.role for r in graph.roles] == [
        "actor",
        "reward",
        "learner",
    ]  # kl_coef 0: no reference
    assert {(e.source, e.target) for e in graph.edges} == {
        ("actor", "learner"),
        ("learner", "actor"),
        ("reward", "learner"),
    }
    assert {e.transport for e in graph.edges} == {"in_process"}
    assert graph.backend == "gloo"


def test_split_placement_crosses_processes(config_file, base_config):
    base_config["algorithm"]["kl_coef"] = 0.1
    base_config["cluster"].update(nproc_per_node=2, placement={"actor": [0], "learner": [1]})
    graph = plan_of(config_file, base_config).graph
    roles = {r.role: r.ranks for r in graph.roles}
    assert roles == {"actor": [0], "reward": [0], "reference": [1], "learner": [1]}
    transports = {(e.source, e.target): e.transport for e in graph.edges}
    assert transports[("actor", "learner")] == "torch_distributed"
    assert transports[("reference", "learner")] == "in_process"
    assert graph.processes[1].roles == ["reference", "learner"]


def test_placements_that_cannot_run_are_refused_with_a_hint(config_file, base_config):
    base_config["algorithm"]["kl_coef"] = 0.1
    base_config["cluster"].update(nproc_per_node=3, placement={"actor": [0, 1], "learner": [1, 2]})
    issue = issues_of(config_file, base_config)["cluster.placement"]
    assert "overlap" in issue.message and "disjoint" in issue.hint
    base_config["cluster"]["placement"] = {"actor": [0], "learner": [1, 2], "reference": [1]}
    issue = issues_of(config_file, base_config)["cluster.placement.reference"]
    assert "beside the learner" in issue.message and "remove reference" in issue.hint


def test_staleness_needs_actors_and_learners_apart(config_file, base_config):
    base_config["algorithm"]["max_staleness"] = 1
    issue = issues_of(config_file, base_config)["algorithm.max_staleness"]
    assert "nothing to overlap" in issue.message and "placement" in issue.hint
    base_config["cluster"].update(nproc_per_node=2, placement={"actor": [0], "learner": [1]})
    assert plan_of(config_file, base_config).config.algorithm.max_staleness == 1


def test_stale_sample_settings_need_staleness(config_file, base_config):
    from rollout.config import validate_config
    from rollout.errors import ConfigError

    base_config["algorithm"].update(stale_samples="drop", tis_bound=3.0)
    with pytest.raises(ConfigError) as caught:
        validate_config(base_config)
    issues = {issue.path: issue for issue in caught.value.issues}
    assert "max_staleness = 0" in issues["algorithm.stale_samples"].message
    assert "max_staleness >= 1" in issues["algorithm.tis_bound"].hint


def test_ppo_has_critic_and_reference(config_file, base_config):
    base_config["algorithm"] = {"kind": "ppo", "kl_coef": 0.05, "rollout_batch_size": 8}
    plan = plan_of(config_file, base_config)
    assert {r.role for r in plan.graph.roles} == {
        "actor",
        "reward",
        "reference",
        "critic",
        "learner",
    }
    assert {"critic", "reference_weights"} <= set(plan.memory[0].items)


def test_gpu_plan_uses_nccl_and_per_gpu_memory(config_file, base_config):
    base_config["cluster"] = {"device": "auto", "nproc_per_node": 2}
    plan = plan_of(config_file, base_config, GPU_BOX)
    assert plan.graph.device == "cuda" and plan.graph.backend == "nccl"
    assert [p.device for p in plan.graph.processes] == ["cuda:0", "cuda:1"]
    assert [m.device for m in plan.memory] == ["cuda:0", "cuda:1"]
    assert plan.derived.dtype == "bfloat16"


def test_memory_that_cannot_fit_names_the_shortfall_and_the_knob(config_file, base_config):
    issue = issues_of(config_file, base_config, TINY_BOX)["cluster"]
    assert "short by" in issue.message and "on cpu" in issue.message
    assert "runtime" in issue.message
    assert issue.hint


def test_cuda_without_gpus_is_refused(config_file, base_config):
    base_config["cluster"]["device"] = "cuda"
    issue = issues_of(config_file, base_config)["cluster.device"]
    assert "no NVIDIA GPU" in issue.message


def test_too_many_gpu_processes_are_refused(config_file, base_config):
    base_config["cluster"] = {"device": "cuda", "nproc_per_node": 4}
    issue = issues_of(config_file, base_config, GPU_BOX)["cluster.nproc_per_node"]
    assert "this machine has 2" in issue.message


def test_context_length_is_checked_against_the_model(config_file, base_config):
    base_config["generation"].update(max_prompt_tokens=1000, max_new_tokens=100)
    issue = issues_of(config_file, base_config)["generation.max_new_tokens"]
    assert "exceeds the model's context of 1024" in issue.message


def test_minibatch_must_split_over_learners(config_file, base_config):
    base_config["cluster"]["nproc_per_node"] = 3
    issue = issues_of(config_file, base_config)["algorithm.minibatch_size"]
    assert "cannot be split evenly over 3 learner processes" in issue.message


def test_vllm_needs_cuda_and_the_package(config_file, base_config):
    base_config["generation"]["engine"] = "vllm"
    base_config["cluster"] = {"device": "auto"}
    issue = issues_of(config_file, base_config)["generation.engine"]
    assert "vllm" in issue.message


def test_float16_training_is_refused(config_file, base_config):
    """On any device (rollout has no loss scaler): already by validate, so plan too."""
    from rollout import ConfigError

    base_config["model"]["dtype"] = "float16"
    with pytest.raises(ConfigError) as caught:
        plan_of(config_file, base_config, GPU_BOX)
    assert [issue.path for issue in caught.value.issues] == ["model.dtype"]


def test_every_stage_reports_at_once(config_file, base_config):
    base_config["model"] = {"path": "no-such-model"}
    base_config["data"]["fields"]["answer"] = "solution"
    base_config["rewards"] = [{"fn": "./missing.py:score"}]
    base_config["cluster"]["device"] = "cuda"
    issues = issues_of(config_file, base_config)
    assert {"model.path", "data.fields.answer", "rewards[0].fn", "cluster.device"} <= set(issues)


def test_reward_signature_is_checked_against_data_fields(config_file, base_config, tmp_path):
    (tmp_path / "rw.py").write_text(
        "def score(prompts, completions, *, rubric):\n    return [0.0] * len(completions)\n"
    )
    base_config["rewards"] = [{"fn": "./rw.py:score", "options": {"strictness": 1}}]
    issues = issues_of(config_file, base_config)
    assert "rewards[0].options.strictness" in issues
    assert any("rubric" in issue.message for issue in issues.values())


def test_a_reward_the_run_cannot_call_is_refused_with_the_call(config_file, base_config, tmp_path):
    (tmp_path / "rw.py").write_text(
        "def score(prompt, completion, **kwargs):\n    return [0.0] * len(completion)\n"
    )
    base_config["rewards"] = [{"fn": "./rw.py:score"}]
    issue = issues_of(config_file, base_config)["rewards[0].fn"]
    assert issue.value == "./rw.py:score"
    assert "score(prompts, completions, answer=[...], prompt=[...])" in issue.message
    assert "'prompt' would get two values" in issue.message


def test_a_reward_taking_only_prompts_and_completions_plans(config_file, base_config, tmp_path):
    """The reward runner passes it no record field (it names none) and no option."""
    (tmp_path / "rw.py").write_text(
        "def score(prompts, completions):\n    return [0.0] * len(completions)\n"
    )
    base_config["rewards"] = [{"fn": "./rw.py:score"}]
    base_config["data"]["fields"] = {"prompt": "prompt"}  # it reads no answer
    assert plan_of(config_file, base_config).plugins[0].signature == "(prompts, completions)"


def test_a_mapped_role_no_reward_reads_is_refused(config_file, base_config, tmp_path):
    """data.fields.answer with only rewards that take no `answer`: accepted, then ignored."""
    (tmp_path / "rw.py").write_text(
        "def score(prompts, completions):\n    return [0.0] * len(completions)\n"
    )
    base_config["rewards"] = [{"fn": "./rw.py:score"}]
    issue = issues_of(config_file, base_config)["data.fields.answer"]
    assert "no reward reads the 'answer' role" in issue.message
    assert issue.hint == "remove data.fields.answer, or give a reward function a 'answer' parameter"
    # A reward that takes it reads it.
    base_config["rewards"].append({"fn": "numeric_match"})
    plan_of(config_file, base_config)


def test_a_reward_field_missing_from_the_eval_data_is_refused(config_file, base_config, tmp_path):
    (tmp_path / "rw.py").write_text(
        "def score(prompts, completions, *, level):\n    return [0.0] * len(completions)\n"
    )
    (tmp_path / "eval.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n')
    base_config["data"]["eval"] = {"path": "eval.jsonl"}
    base_config["data"]["fields"] = {"prompt": "prompt"}
    base_config["rewards"] = [{"fn": "./rw.py:score"}]
    path = config_file(base_config)
    records = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    (tmp_path / "train.jsonl").write_text(
        "".join(json.dumps({**r, "level": 1}) + "\n" for r in records)
    )
    with pytest.raises(PlanError) as caught:
        build_plan(path, hardware=LAPTOP)
    (issue,) = caught.value.issues
    assert issue.path == "rewards[0].fn"
    assert issue.message.endswith("neither an option nor a field of the eval data")


def test_seeds_are_derived_stably_and_independently():
    assert derive_seed(0, "data") == derive_seed(0, "data")
    assert derive_seed(0, "data") != derive_seed(0, "sampling")
    assert derive_seed(0, "data") != derive_seed(1, "data")


def test_plan_records_versions_without_importing_torch(config_file, base_config):
    plan = plan_of(config_file, base_config)
    assert plan.versions.rollout
    assert plan.versions.python.count(".") == 2


def test_prompts_must_split_over_actor_processes(config_file, base_config):
    base_config["algorithm"].update(rollout_batch_size=12, num_generations=4, minibatch_size=6)
    base_config["cluster"]["nproc_per_node"] = 2
    issue = issues_of(config_file, base_config)["algorithm.rollout_batch_size"]
    assert "3 prompts per step cannot be shared evenly by 2 actor processes" in issue.message
