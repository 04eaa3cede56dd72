"""[environment] in the config and the plan: what validate refuses, what plan resolves and
checks (the plugin, its options, the episode's context budget), and what plan.lock records."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rollout import ConfigError
from rollout.config import validate_config
from rollout.errors import PlanError
from rollout.planner.builder import build_plan

GUESS = {"name": "guess_number", "max_turns": 3, "options": {"low": 1, "high": 9}}


def multi_turn(base: dict[str, Any], **environment: Any) -> dict[str, Any]:
    raw = copy.deepcopy(base)
    raw["environment"] = {**GUESS, **environment}
    raw.pop("rewards")
    raw["data"]["fields"].pop("answer")
    return raw


def issues_of(raw: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(ConfigError) as caught:
        validate_config(raw)
    return {issue.path: issue for issue in caught.value.issues}


def test_a_multi_turn_environment_validates_without_rewards(base_config):
    config = validate_config(multi_turn(base_config))
    assert config.environment is not None and config.environment.max_turns == 3


@pytest.mark.parametrize(
    ("change", "path", "says"),
    [
        ({"rewards": [{"fn": "numeric_match"}]}, "rewards", "would be ignored"),
        ({"data": {"use_chat_template": False}}, "data.use_chat_template", "conversation"),
    ],
)
def test_validate_refuses_what_multi_turn_episodes_cannot_do(base_config, change, path, says):
    raw = multi_turn(base_config)
    for section, values in change.items():
        if isinstance(values, dict) and isinstance(raw.get(section), dict):
            raw[section].update(values)
        else:
            raw[section] = values
    found = issues_of(raw)
    assert path in found and says in found[path].message, found


@pytest.mark.parametrize("kind", ["ppo", "reinforce_pp"])
@pytest.mark.parametrize("advantage", ["episode", "turn"])
def test_the_per_token_kinds_train_on_multi_turn_episodes(base_config, kind, advantage):
    raw = multi_turn(base_config, advantage=advantage)
    raw["algorithm"]["kind"] = kind
    config = validate_config(raw)
    assert config.algorithm.kind == kind and config.environment.advantage == advantage


SPLIT = {"nproc_per_node": 2, "placement": {"actor": [0], "learner": [1]}}


def test_a_multi_turn_environment_validates_with_actors_and_learners_apart(base_config):
    raw = multi_turn(base_config)
    raw["cluster"] = {**raw.get("cluster", {}), **SPLIT}
    config = validate_config(raw)
    assert config.cluster.placement == {"actor": [0], "learner": [1]}


def test_agents_with_a_split_placement_are_refused_saying_why(base_config):
    raw = agent_config(base_config)
    raw["cluster"] = {**raw.get("cluster", {}), **SPLIT}
    message = issues_of(raw)["environment.name"].message
    assert "split placement" in message and "fixed shares" in message


def test_the_single_turn_environment_takes_no_turns_or_options(base_config):
    raw = copy.deepcopy(base_config)
    raw["environment"] = {"name": "single_turn", "max_turns": 2, "options": {"x": 1}}
    found = issues_of(raw)
    assert "one answer" in found["environment.max_turns"].message
    assert "takes no options" in found["environment.options"].message


def test_an_environment_needs_an_online_kind(base_config):
    raw = copy.deepcopy(base_config)
    raw["algorithm"] = {"kind": "sft", "batch_size": 4}
    raw.pop("rewards")
    raw.pop("generation")
    raw["data"]["fields"] = {"prompt": "prompt", "completion": "answer"}
    raw["environment"] = GUESS
    assert "no episodes" in issues_of(raw)["environment"].message


def test_plan_resolves_the_environment_and_records_it(config_file, base_config):
    plan = build_plan(config_file(multi_turn(base_config)))
    assert plan.environment is not None and plan.environment.ref == "guess_number"
    assert plan.environment in plan.plugins  # freshness checks and explain see it


def test_plan_records_a_file_environment_by_its_hash(config_file, base_config, tmp_path):
    (tmp_path / "game.py").write_text(
        "class Game:\n"
        "    def __init__(self, level=1): ...\n"
        "    def reset(self, rows, *, seed): return ['Go.' for _ in rows]\n"
    )
    plan = build_plan(config_file(multi_turn(base_config, name="./game.py:Game", options={})))
    assert plan.environment.kind == "file" and len(plan.environment.sha256) == 64


def plan_issues(config_file, raw) -> dict[str, Any]:
    with pytest.raises(PlanError) as caught:
        build_plan(config_file(raw))
    return {issue.path: issue for issue in caught.value.issues}


def test_plan_refuses_options_the_environment_does_not_take(config_file, base_config):
    found = plan_issues(config_file, multi_turn(base_config, options={"hgh": 9}))
    assert "unexpected keyword argument 'hgh'" in found["environment.options"].message


def test_plan_builds_a_built_in_with_its_options_so_bad_values_fail_there(config_file, base_config):
    found = plan_issues(config_file, multi_turn(base_config, options={"low": 5, "high": 5}))
    assert "low (5) must be below high (5)" in found["environment.options"].message


def test_plan_names_an_unknown_environment(config_file, base_config):
    found = plan_issues(config_file, multi_turn(base_config, name="guess_numbr"))
    assert "environment.name" in found
    assert "guess_number" in str(found["environment.name"])  # did you mean


def test_plan_checks_the_episode_fits_the_models_context(config_file, base_config):
    raw = multi_turn(base_config, max_turns=64, max_observation_tokens=4096)
    found = plan_issues(config_file, raw)
    message = found["environment.max_turns"].message
    assert "max_turns 64 x max_new_tokens 8" in message and "model's context of" in message


def test_an_environment_with_memory_plans_in_one_process_only(config_file, base_config, tmp_path):
    (tmp_path / "game.py").write_text("class Game:\n    def __init__(self, memory): ...\n")
    raw = multi_turn(base_config, name="./game.py:Game", options={})
    assert build_plan(config_file(raw)).environment is not None
    raw["cluster"]["nproc_per_node"] = 2
    found = plan_issues(config_file, raw)
    assert "episodic memory" in found["environment.name"].message
    # One actor on a process of its own keeps it (the learners checkpoint it); two do not.
    raw["cluster"]["placement"] = {"actor": [0], "learner": [1]}
    assert build_plan(config_file(raw)).environment is not None
    raw["cluster"]["nproc_per_node"] = 3
    raw["cluster"]["placement"] = {"actor": [0, 1], "learner": [2]}
    assert "episodic memory" in plan_issues(config_file, raw)["environment.name"].message
    raw["cluster"]["nproc_per_node"] = 1
    raw["cluster"].pop("placement")
    raw["environment"]["options"] = {"memory": 1}
    assert "passes itself" in plan_issues(config_file, raw)["environment.options.memory"].message


def agent_config(base_config, **environment: Any) -> dict[str, Any]:
    raw = copy.deepcopy(base_config)
    raw["environment"] = {
        "name": "agent",
        "options": {"command": "python agent.py"},
        "max_turns": 4,
        **environment,
    }
    return raw


@pytest.mark.parametrize(
    ("change", "path", "says"),
    [
        ({"rewards": []}, "rewards", "final answer with [[rewards]]"),
        ({"environment.advantage": "turn"}, "environment.advantage", "one return"),
        ({"environment.max_observation_tokens": 32}, "environment.max_observation_tokens", "cut"),
        ({"cluster.nproc_per_node": 2}, "environment.name", "one process"),
        ({"algorithm.kind": "ppo"}, "environment.name", "does not train on agent episodes"),
    ],
)
def test_validate_refuses_what_agent_episodes_do_not_read(base_config, change, path, says):
    raw = agent_config(base_config)
    for dotted, value in change.items():
        section, _, key = dotted.partition(".")
        if key:
            raw.setdefault(section, {})[key] = value
        else:
            raw[section] = value
    found = issues_of(raw)
    assert path in found and says in found[path].message, found


def test_plan_checks_the_agents_options_and_command(config_file, base_config, tmp_path):
    raw = agent_config(base_config)
    found = plan_issues(config_file, raw)
    assert "no script agent.py" in found["environment.options.command"].message
    (tmp_path / "agent.py").write_text("print('4')\n")
    plan = build_plan(config_file(raw))
    assert plan.environment is not None and plan.environment.ref == "agent"
    raw["environment"]["options"]["concurrency"] = 0
    assert (
        "concurrency must be 1 to 1024"
        in plan_issues(config_file, raw)["environment.options"].message
    )


GAMES = """
import time


class Wordy:
    \"\"\"Opens each episode with its rules, far longer than the prompt.\"\"\"

    def __init__(self, rules=40):
        self.rules = rules

    def reset(self, rows, *, seed):
        return [" ".join(["rule"] * self.rules) + " " + row["prompt"] for row in rows]

    def step(self, episodes, actions):
        raise AssertionError("the plan only opens episodes")


class Picky(Wordy):
    def reset(self, rows, *, seed):
        if any(row["prompt"] == "What is 4 + 1?" for row in rows):
            raise KeyError("level")
        return super().reset(rows, seed=seed)


class Slow(Wordy):
    def reset(self, rows, *, seed):
        time.sleep(5)
"""


def test_plan_counts_a_plugin_environments_first_observation_against_max_prompt_tokens(
    config_file, base_config, tmp_path
):
    """The worker refuses an episode whose first observation passes max_prompt_tokens: the plan,
    which resets the environment on every record as the worker will, refuses it first."""
    (tmp_path / "games.py").write_text(GAMES)
    fits = multi_turn(base_config, name="./games.py:Wordy", options={"rules": 1})
    assert build_plan(config_file(fits)).environment.ref == "./games.py:Wordy"
    found = plan_issues(config_file, multi_turn(base_config, name="./games.py:Wordy", options={}))
    issue = found["generation.max_prompt_tokens"]
    assert "as environment './games.py:Wordy' opens the episode" in issue.message
    assert "longer than max_prompt_tokens 32" in issue.message


def test_plan_names_the_record_an_environment_cannot_open(config_file, base_config, tmp_path):
    (tmp_path / "games.py").write_text(GAMES)
    raw = multi_turn(base_config, name="./games.py:Picky", options={"rules": 1})
    issue = plan_issues(config_file, raw)["environment.name"]
    assert "cannot open an episode on this record: reset raised KeyError" in issue.message
    assert "line 5" in issue.message  # "What is 4 + 1?" is the fifth record
    hung = multi_turn(base_config, name="./games.py:Slow", options={"rules": 1}, timeout_s=0.2)
    issue = plan_issues(config_file, hung)["environment.name"]
    assert "did not return within environment.timeout_s = 0.2" in issue.message
