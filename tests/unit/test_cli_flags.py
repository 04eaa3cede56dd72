"""Boolean flags are flags, in every command: --help shows `--logprobs`, never `--logprobs <bool>`
(typer 0.29's rich help printed a type beside every option; rollout/cli/options.py
render_flags_as_flags), and each flag works bare, as `--flag`."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from rollout.cli.app import app

runner = CliRunner()


def commands(command=None, path=()):
    """(path, command) for the root and every command and sub-command under it."""
    command = command or typer.main.get_command(app)
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from commands(sub, (*path, name))


COMMANDS = dict(commands())
FLAGS = [
    (path, param.name, option, option in param.opts)
    for path, command in COMMANDS.items()
    for param in command.params
    if getattr(param, "is_flag", False)
    for option in (*param.opts, *param.secondary_opts)
]
EXPECTED_FLAGS = {
    "--version", "--logprobs", "--no-carry", "--overwrite", "--chat-template",
    "--no-chat-template", "--follow", "-f", "--explain", "--check",
}  # fmt: skip


def test_every_boolean_flag_is_found():
    assert {option for _, _, option, _ in FLAGS} >= EXPECTED_FLAGS


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda path: " ".join(path) or "rollout")
def test_help_shows_flags_without_a_value(path):
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output
    for flag_path, _, option, _ in FLAGS:
        if flag_path == path:
            assert option in result.output


# --version acts at once (its callback prints and exits): its own test below.
VALUED_FLAGS = [flag for flag in FLAGS if flag[2] != "--version"]


@pytest.mark.parametrize(
    ("path", "name", "option", "value"),
    VALUED_FLAGS,
    ids=[f"{' '.join(path) or 'rollout'} {option}" for path, _, option, _ in VALUED_FLAGS],
)
def test_each_flag_works_bare(path, name, option, value):
    """Parsed as the command line would be (missing required options aside)."""
    command = COMMANDS[path]
    context = command.make_context(" ".join(path) or "rollout", [option], resilient_parsing=True)
    assert context.params[name] is value


def test_the_version_flag_prints_the_version():
    from rollout import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"rollout {__version__}"


def test_a_flag_given_a_value_is_a_usage_error_not_a_value():
    result = runner.invoke(
        app, ["generate", "--prompts", "p.jsonl", "--out", "o.jsonl", "--logprobs", "true"]
    )
    assert result.exit_code == 2
    assert "unexpected extra argument" in result.output.lower()


def test_generate_takes_max_batch_size_as_serve_does():
    for command in ("generate", "serve"):
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert "--max-batch-size" in result.output
