"""The plan's reward records: built once by the planner, used as they are by the worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.errors import LockfileError
from rollout.executor.preflight import verify_plan
from rollout.planner.builder import build_plan
from rollout.planner.definition import FunctionRewardRecord, Plan
from rollout.planner.lockfile import read_plan, write_plan
from rollout.runtime.components import build_reward_functions
from tests.conftest import write_toml

PLUGIN = """
def longer(prompts, completions, *, answer, chars=1):
    return [float(len(c) > chars) for c in completions]
"""


@pytest.fixture
def planned(tmp_path: Path, base_config) -> tuple[Plan, Path]:
    """A plan with a built-in and a file-plugin reward, written to plan.lock beside its config."""
    (tmp_path / "train.jsonl").write_text('{"prompt": "1 + 1?", "answer": "2"}\n' * 8)
    (tmp_path / "rewards.py").write_text(PLUGIN)
    base_config["run"]["output_dir"] = str(tmp_path / "runs")
    base_config["rewards"] = [
        {"fn": "numeric_match"},
        {
            "fn": "./rewards.py:longer",
            "name": "long",
            "weight": 0.25,
            "options": {"chars": 3},
            "timeout_s": 7.5,
        },
    ]
    plan = build_plan(write_toml(tmp_path / "run.toml", base_config))
    lock = tmp_path / "plan.lock"
    write_plan(plan, lock)
    return plan, lock


def test_the_planner_writes_one_record_per_reward(planned):
    plan, lock = planned
    builtin, plugin = read_plan(lock).rewards
    assert isinstance(plugin, FunctionRewardRecord)
    assert (builtin.name, builtin.weight, builtin.options) == ("numeric_match", 1.0, {})
    assert (plugin.name, plugin.weight, plugin.options, plugin.timeout_s) == (
        "long",
        0.25,
        {"chars": 3},
        7.5,
    )
    assert plugin.plugin.used_by == "rewards[1].fn" and plugin.plugin.kind == "file"
    assert plan.plugins == [builtin.plugin, plugin.plugin]


def test_the_worker_builds_its_reward_functions_from_the_records_alone(planned, monkeypatch):
    plan, lock = planned
    Path(plan.config_path).unlink()  # nothing to read again

    def never(*args, **kwargs):
        raise AssertionError("the worker resolved a reward again")

    for identify in ("builtin_identity", "module_identity", "file_identity"):
        monkeypatch.setattr(f"rollout.plugins.resolve.{identify}", never)
    read = read_plan(lock, check_fresh=False)
    # A config without rewards: the records alone say what to call, and how.
    without = read.model_copy(update={"config": read.config.model_copy(update={"rewards": []})})
    functions = build_reward_functions(without)
    assert [(f.name, f.weight, dict(f.options), f.timeout_s) for f in functions] == [
        ("numeric_match", 1.0, {}, 30.0),
        ("long", 0.25, {"chars": 3}, 7.5),
    ]
    assert functions[1].accepts == frozenset({"answer", "chars"})
    assert functions[1].fn(["p", "p"], ["ab", "abcd"], answer=["2", "2"], chars=3) == [0.0, 1.0]


def test_a_reward_plugin_changed_after_planning_is_refused_by_the_host(planned, tmp_path):
    _, lock = planned
    plugin = tmp_path / "rewards.py"
    plugin.write_text(PLUGIN + "# tuned\n")
    with pytest.raises(LockfileError) as refused:
        verify_plan(lock)
    (issue,) = refused.value.issues
    assert issue.path == "rewards[1].fn"
    assert f"{plugin.resolve()} changed since planning" in issue.message
