"""What a tool is: an OpenAI function-calling schema (name, description, parameters as JSON
Schema) and the code that answers a call, given the call's arguments and the episode it is made in.

A tool's answer is text for the model. What the model did wrong (arguments the tool cannot use, a
path outside its directory, a program not allowed) is a ToolError, or a sandbox's Refused: its
message goes back to the model as the tool's answer. A host that cannot give the isolation the
plan required (SandboxUnavailable) is not the model's fault and is raised.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolError(Exception):
    """The call cannot be carried out as asked; the message tells the model why."""


@dataclass(frozen=True)
class ToolContext:
    """Where a call runs: the episode's own directory (files, python and shell share it), and
    whether a sandbox must refuse to run without network isolation."""

    workdir: Path
    require_network_isolation: bool = True


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]
    """JSON Schema of the arguments object (checked before `run` is called)."""
    run: Callable[[dict[str, Any], ToolContext], str]
    runs_code: bool = False
    """Whether it executes model-written code (then the plan requires a working sandbox)."""
    example: Mapping[str, Any] | None = None
    """Arguments of a typical call, shown to the model as an example (small models copy the
    format far more reliably from one)."""
    max_s: float = 0.0
    """The longest one call may take (its own time limit); 0 for a tool that answers at once.
    A call is not started when the turn has less time left than this."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling declaration the model is shown."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


def function_schema(raw: Any, where: str) -> tuple[str, str, dict[str, Any]]:
    """(name, description, parameters) from an OpenAI function declaration, either the function
    object itself or {"type": "function", "function": {...}}; ValueError naming what is wrong."""
    if isinstance(raw, Mapping) and raw.get("type") == "function" and "function" in raw:
        raw = raw["function"]
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: a function schema is a table, got {type(raw).__name__}")
    unknown = set(raw) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {sorted(unknown)}: a function schema has name, "
            "description and parameters"
        )
    name, description = raw.get("name"), raw.get("description", "")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"{where}: name {name!r} must be 1-64 letters, digits, '_' or '-' (OpenAI's rule)"
        )
    if not isinstance(description, str):
        raise ValueError(f"{where}: description must be text")
    parameters = raw.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
        raise ValueError(f"{where}: parameters must be a JSON Schema with type 'object'")
    try:
        jsonschema.Draft202012Validator.check_schema(parameters)
    except jsonschema.SchemaError as error:
        raise ValueError(
            f"{where}: parameters is not a valid JSON Schema: {error.message}"
        ) from None
    return name, description, dict(parameters)
