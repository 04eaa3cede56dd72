"""`rollout validate` as a user meets it: exit codes, messages, JSON output, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollout.cli.app import app

runner = CliRunner()


def test_valid_config_exits_zero(config_file, base_config):
    result = runner.invoke(app, ["validate", "--config", str(config_file(base_config))])
    assert result.exit_code == 0, result.output
    assert "is valid: grpo on builtin:tiny-llama, 2 steps" in result.output


def test_every_problem_is_listed_with_path_value_and_hint(config_file, base_config):
    base_config["algorithm"]["rollout_batch_size"] = 10
    base_config["generation"]["engine"] = "vlm"
    result = runner.invoke(app, ["validate", "--config", str(config_file(base_config))])
    assert result.exit_code == 2
    assert "2 problems" in result.output
    assert "algorithm.rollout_batch_size" in result.output
    assert "hint: use 8 or 12" in result.output
    assert "generation.engine" in result.output and "did you mean 'vllm'?" in result.output
    assert "Traceback" not in result.output


def test_json_format_lists_the_same_errors(config_file, base_config):
    base_config["algorithm"]["num_generations"] = 0
    path = config_file(base_config)
    result = runner.invoke(app, ["validate", "--config", str(path), "--format", "json"])
    assert result.exit_code == 2
    report = json.loads(result.output)
    assert report["error_count"] == len(report["errors"]) >= 1
    error = next(e for e in report["errors"] if e["path"] == "algorithm.num_generations")
    assert error["value"] == 0 and error["message"] == "must be at least 2"


def test_set_overrides_fix_and_break(config_file, base_config):
    base_config["algorithm"]["rollout_batch_size"] = 10
    path = str(config_file(base_config))
    fixed = runner.invoke(app, ["validate", "-c", path, "--set", "algorithm.rollout_batch_size=12"])
    assert fixed.exit_code == 0, fixed.output
    bad = runner.invoke(app, ["validate", "-c", path, "--set", "algorithm"])
    assert bad.exit_code == 2 and "expected KEY=VALUE" in bad.output


def test_missing_algorithm_kind_lists_the_choices(config_file, base_config):
    base_config["algorithm"] = {"max_steps": 3}
    result = runner.invoke(app, ["validate", "-c", str(config_file(base_config))])
    assert result.exit_code == 2
    assert "algorithm.kind: missing required key; choose one of 'grpo'" in result.output


def test_user_errors_never_show_a_traceback(tmp_path):
    for args in (
        ["validate", "-c", str(tmp_path / "nope.toml")],
        ["validate", "-c", str(tmp_path)],
        ["plan", "-c", str(tmp_path / "nope.yaml")],
        ["run", "--plan", str(tmp_path / "plan.lock")],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "Traceback" not in result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("rollout ")


def test_a_bug_gets_one_line_and_its_traceback_a_file(monkeypatch, capsys):
    """Not a user mistake (no RolloutError): still no traceback on the terminal."""
    from rollout.cli import app as cli

    def broken() -> None:
        raise RuntimeError("boom at https://u:Canary5ecret@host/x")

    monkeypatch.setattr(cli, "app", broken)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("rollout: internal error: RuntimeError: boom at https://u:***@host/x")
    assert "Traceback" not in err and "Canary5ecret" not in err
    saved = err.split("the traceback is in ")[1].split("\n")[0]
    text = Path(saved).read_text(encoding="utf-8")
    assert "Traceback" in text and "broken" in text and "Canary5ecret" not in text
