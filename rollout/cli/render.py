"""Rendering user errors: one clear message per problem, exit code 2, never a traceback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import typer
from rich.console import Console
from rich.markup import escape

from rollout.errors import USER_ERROR_EXIT_CODE, RolloutError

OutputFormat = Literal["text", "json"]

stdout = Console(highlight=False, soft_wrap=True)
stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def render_error(error: RolloutError, fmt: OutputFormat = "text") -> None:
    if fmt == "json":
        stdout.print_json(json.dumps(error.to_dict()))
        return
    count = len(error.issues)
    where = f"{escape(error.source)}: " if error.source else ""
    noun = "problem" if count == 1 else "problems"
    stderr.print(f"[bold red]error[/]: {where}{count} {noun}")
    for issue in error.issues:
        line = f"  [bold]{escape(issue.path)}[/]: {escape(issue.message)}"
        if issue.has_value:
            line += f" [dim](got {escape(_short(issue.value))})[/]"
        stderr.print(line)
        if issue.hint:
            stderr.print(f"      [cyan]hint[/]: {escape(issue.hint)}")


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextmanager
def user_errors(fmt: OutputFormat = "text") -> Iterator[None]:
    """Turn a RolloutError raised inside the block into rendered issues and exit code 2."""
    try:
        yield
    except RolloutError as error:
        render_error(error, fmt)
        raise typer.Exit(USER_ERROR_EXIT_CODE) from None
