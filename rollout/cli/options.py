"""Options shared by several commands, declared once."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer


class Format(str, Enum):
    text = "text"
    json = "json"


ConfigOption = Annotated[
    Path,
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
        "read as TOML (null unsets a key); anything else is a string.",
    ),
]
FormatOption = Annotated[
    Format, typer.Option("--format", help="Output format: text for people, json for tools.")
]
