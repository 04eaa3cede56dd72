"""`rollout plan --probe N`: the starting model sampled on the run's first prompts, scored as the
run scores; a dead reward warned about before the run, the step time measured."""

from __future__ import annotations

import copy
import json

import pytest
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.inference.probe import probe
from rollout.planner.builder import build_plan

runner = CliRunner()

# Scores that must vary across a random model's completions (their lengths differ), and a
# reward that is always 0.
LENGTHS = [{"fn": "length_penalty", "options": {"target_chars": 1}}]
NEVER = [{"fn": "regex_match", "options": {"pattern": "^NEVER-MATCHES$", "full": True}}]


def config(base_config, rewards) -> dict:
    raw = copy.deepcopy(base_config)
    raw["rewards"] = rewards
    raw["data"]["fields"].pop("answer")
    return raw


def test_a_probe_of_a_varied_reward_reports_groups_and_step_time(config_file, base_config):
    plan = build_plan(config_file(config(base_config, LENGTHS)))
    report = probe(plan, completions=4, prompts=3)
    assert report.prompts == 3 and [len(g) for g in report.group_rewards] == [4, 4, 4]
    assert report.uniform_groups < 3 and not report.warnings
    assert report.generate_s > 0 and report.train_s > 0
    # a step handles prompts_per_rank x num_generations completions: scaled from the 12 probed
    per_step = plan.derived.prompts_per_rank * plan.config.algorithm.num_generations
    measured = report.generate_s + report.score_s + report.train_s
    assert report.step_s == pytest.approx(measured * per_step / 12)


def test_a_probe_warns_when_every_completion_scores_zero(config_file, base_config):
    plan = build_plan(config_file(config(base_config, NEVER)))
    report = probe(plan, completions=3, prompts=2)
    assert report.uniform_groups == 2
    (warning,) = report.warnings
    assert "every probed completion scored 0" in warning and "cannot learn" in warning


def test_the_cli_prints_the_probe_and_its_warning(config_file, base_config, tmp_path):
    path = config_file(config(base_config, NEVER))
    lock = tmp_path / "p.lock"
    result = runner.invoke(app, ["plan", "--config", str(path), "-o", str(lock), "--probe", "2"])
    assert result.exit_code == 0, result.output  # a warning, not a refusal: the plan is written
    assert lock.exists()
    assert "probe: 2 completions per prompt" in result.output
    assert "warning: every probed completion scored 0" in " ".join(result.output.split())
    as_json = runner.invoke(
        app, ["plan", "--config", str(path), "-o", str(lock), "--probe", "2", "--format", "json"]
    )
    report = json.loads(as_json.output)["probe"]
    assert report["uniform_groups"] == len(report["group_rewards"]) and report["warnings"]


def test_probe_is_refused_for_offline_kinds_and_below_two(config_file, base_config, tmp_path):
    raw = copy.deepcopy(base_config)
    raw["algorithm"] = {"kind": "sft", "batch_size": 4}
    raw.pop("rewards")
    raw.pop("generation")
    raw["data"]["fields"] = {"prompt": "prompt", "completion": "answer"}
    lock = tmp_path / "p.lock"
    result = runner.invoke(
        app, ["plan", "--config", str(config_file(raw)), "-o", str(lock), "--probe", "4"]
    )
    assert result.exit_code == 2 and "no completions to probe" in result.output
    assert not lock.exists()  # refused before anything was written
    one = runner.invoke(
        app, ["plan", "--config", str(config_file(base_config)), "-o", str(lock), "--probe", "1"]
    )
    assert one.exit_code == 2
