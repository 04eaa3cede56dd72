"""`rollout schema`: write, print or check the files generated from the config models."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from rollout.cli.render import stderr, stdout
from rollout.schema import PATHS, artifact_text, generated_files, stale_files, write_files


class Artifact(str, Enum):
    json = "json"
    python = "python"
    markdown = "markdown"
    sidecar = "sidecar"


ArtifactOption = Annotated[
    Artifact | None,
    typer.Option(
        "--format",
        help="Print only this artifact to stdout (with --check: check only "
        "it). json: the JSON Schema, python: the .pyi stubs, markdown: the reference, "
        "sidecar: the sidecar protocol's JSON Schema.",
    ),
]
RootOption = Annotated[
    Path, typer.Option("--root", help="Repository root the generated files live under.")
]
CheckOption = Annotated[
    bool, typer.Option("--check", help="Write nothing; exit 1 if a generated file is out of date.")
]


def schema(
    fmt: ArtifactOption = None, root: RootOption = Path("."), check: CheckOption = False
) -> None:
    """Generate the JSON Schema, type stubs and config reference from the config models."""
    if check:
        _check(root, fmt)
    elif fmt is not None:
        # Plain echo, not rich: the artifact must come out byte for byte (no markup, no wrapping).
        typer.echo(artifact_text(fmt.value), nl=False)
    else:
        _write(root)


def _write(root: Path) -> None:
    changed = write_files(root)
    for path in changed:
        stdout.print(f"wrote {escape(path)}")
    if not changed:
        stdout.print(f"[green]✓[/] {len(PATHS)} generated file(s) up to date")


def _check(root: Path, fmt: Artifact | None) -> None:
    files = {PATHS[fmt.value]: artifact_text(fmt.value)} if fmt else generated_files()
    stale = stale_files(root, files)
    if not stale:
        stdout.print(f"[green]✓[/] {len(files)} generated file(s) up to date")
        return
    for path in stale:
        stderr.print(f"[bold red]out of date[/]: {escape(path)}")
    command = "rollout schema" if root == Path(".") else f"rollout schema --root {root}"
    stderr.print(f"run `{escape(command)}` and commit the result")
    raise typer.Exit(1)
