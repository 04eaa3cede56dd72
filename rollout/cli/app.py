"""The `rollout` command: each command (or group) is defined in its own module and registered here;
the command modules never import this one."""

from __future__ import annotations

import os
import sys
import tempfile
import traceback

import click
import typer
from typer.core import TyperGroup

from rollout.cli import (
    checkpoints,
    eval,
    generate,
    logs,
    memory,
    plan,
    plugins,
    report,
    run,
    runs,
    schema,
    serve,
    snapshot,
    validate,
)
from rollout.cli.options import render_flags_as_flags
from rollout.redact import redact_text
from rollout.version import __version__

render_flags_as_flags()

# `rollout --help` lists commands in the order a user meets them: check, freeze, run, watch; then
# inference; then tooling (typer would list single commands before groups).
COMMAND_ORDER = (
    "validate",
    "plan",
    "run",
    "runs",
    "logs",
    "checkpoints",
    "snapshot",
    "generate",
    "eval",
    "serve",
    "plugins",
    "schema",
)


class _InPipelineOrder(TyperGroup):
    def list_commands(self, ctx: click.Context) -> list[str]:
        known = [name for name in COMMAND_ORDER if name in self.commands]
        return known + sorted(set(self.commands) - set(known))


app = typer.Typer(
    cls=_InPipelineOrder,
    name="rollout",
    help="Train LLMs with reinforcement learning from one declarative config.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"rollout {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """rollout: validate a config, plan it into plan.lock, run the plan."""


app.command()(validate.validate)
app.add_typer(plan.plan_app, name="plan")
app.command()(run.run)
app.add_typer(runs.runs)
app.command()(report.report)
app.add_typer(logs.logs)
app.add_typer(checkpoints.checkpoints)
app.add_typer(memory.memory)
app.add_typer(snapshot.snapshot)
app.command()(generate.generate)
app.command("eval")(eval.eval_command)
app.command()(serve.serve)
app.add_typer(plugins.plugins)
app.command()(schema.schema)


DEBUG_ENV = "ROLLOUT_DEBUG"


def main() -> None:
    """The `rollout` command. A user's mistake is a RolloutError, rendered by each command with
    exit code 2; anything else is a bug in rollout, and still gets one line, not a traceback:
    the traceback goes to a file named in that line (or to the terminal with ROLLOUT_DEBUG=1)."""
    try:
        app()
    except Exception as error:  # SystemExit (typer's exits) and KeyboardInterrupt pass through
        if os.environ.get(DEBUG_ENV):
            raise
        saved = _save_traceback(error)
        message = redact_text(f"{type(error).__name__}: {error}")
        sys.stderr.write(
            f"rollout: internal error: {message}\n"
            f"  this is a bug in rollout, not in your config; the traceback is in {saved}\n"
            "  (please report it with that file; ROLLOUT_DEBUG=1 shows it here)\n"
        )
        sys.exit(1)


def _save_traceback(error: BaseException) -> str:
    text = redact_text("".join(traceback.format_exception(error)))
    handle, path = tempfile.mkstemp(prefix="rollout-error-", suffix=".txt")
    with os.fdopen(handle, "w", encoding="utf-8") as file:
        file.write(text)
    return path
