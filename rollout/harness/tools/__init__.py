"""Tools a model calls during an episode (the `tools` environment): OpenAI function-calling
declarations, the built-ins (calculator, python, shell, files, http_get), user functions as
plugins, and the parsing of calls out of the model's answers. See docs/tools.md."""

from rollout.harness.tools.base import Tool, ToolContext, ToolError, function_schema
from rollout.harness.tools.builtin import BUILTIN_TOOLS
from rollout.harness.tools.calls import (
    FORMATS,
    BadCall,
    Outcome,
    Toolbox,
    ToolCall,
    ToolFormat,
    parse_calls,
)
from rollout.harness.tools.plugin import plugin_tool

__all__ = [
    "BUILTIN_TOOLS",
    "FORMATS",
    "BadCall",
    "Outcome",
    "Tool",
    "ToolCall",
    "ToolContext",
    "ToolError",
    "ToolFormat",
    "Toolbox",
    "function_schema",
    "parse_calls",
    "plugin_tool",
]
