"""The `rollout` command. Each command group lives in its own module and registers itself here."""

from __future__ import annotations

import typer

from rollout import __version__

app = typer.Typer(
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


def _register() -> None:
    # Imported for their side effect of adding commands to `app`.
    from rollout.cli import generate, logs, plan, run, runs, schema, serve, validate  # noqa: F401


_register()


def main() -> None:
    app()
