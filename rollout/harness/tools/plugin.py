"""A user's function as a tool: `module:function` or `./file.py:function`, called with the call's
arguments as keyword arguments; what it returns is the answer (text as is, anything else as
JSON). Its declaration comes from the config (environment.tools[].function) or from the
function's own `schema` attribute."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from rollout.harness.tools.base import Tool, ToolContext, function_schema


class ToolFunction(Protocol):
    """A tool plugin: called with the call's arguments as keyword arguments; returns its answer
    (text, or anything JSON-able). ``schema``: its OpenAI function declaration, unless the
    config gives one (environment.tools[].function). Built-in tools are factories returning a
    Tool instead (tools/builtin.py)."""

    schema: Mapping[str, Any]

    def __call__(self, **arguments: Any) -> Any: ...


def plugin_tool(fn: Callable[..., Any], function: Mapping[str, Any] | None, where: str) -> Tool:
    raw = function if function is not None else getattr(fn, "schema", None)
    if raw is None:
        raise ValueError(
            f"{where}: the tool has no schema: give its OpenAI function declaration as "
            "environment.tools[].function, or set a `schema` attribute on the function"
        )
    name, description, parameters = function_schema(raw, where)

    def run(arguments: dict[str, Any], context: ToolContext) -> str:
        result = fn(**arguments)
        return result if isinstance(result, str) else json.dumps(result, default=str)

    # JSON Schema's own "examples" keyword: the first one is shown to the model
    examples = parameters.get("examples")
    example = examples[0] if isinstance(examples, list) and examples else None
    return Tool(
        name, description, parameters, run, example=example if isinstance(example, dict) else None
    )
