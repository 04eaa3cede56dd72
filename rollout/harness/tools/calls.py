"""Tool calls in the model's answer, in the chat template's tool format, and the toolbox that
checks and runs them.

Formats:
- "hermes" (Hermes, Qwen 2/2.5/3 and most open templates): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; an answer without `<tool_call>` is
  a final answer. A last block the answer cut off before `</tool_call>` still counts.
- "json": the whole answer (a ```json fence allowed) is one object
  `{"name": ..., "arguments": {...}}`; any other answer is a final answer, except one that starts
  with "{" and is not valid JSON, which is a malformed call.

Whatever is wrong with a call (bad JSON, no name, an unknown tool, arguments that fail the tool's
schema) is a BadCall whose `problem` is told to the model; nothing the model writes raises.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from rollout.harness.sandbox import Refused, SandboxUnavailable
from rollout.harness.tools.base import Tool, ToolContext, ToolError

ToolFormat = Literal["hermes", "json"]
FORMATS: tuple[str, ...] = ("hermes", "json")
MAX_CALLS_PER_ANSWER = 8
"""More calls in one answer are refused (each one past it is a BadCall)."""

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class BadCall:
    problem: str
    """What is wrong, worded for the model."""
    name: str | None = None


def parse_calls(text: str, format: ToolFormat) -> list[ToolCall | BadCall]:
    """The calls an answer makes, in order; [] when it makes none (a final answer)."""
    if format == "hermes":
        blocks = [match.group(1) for match in _HERMES.finditer(text)]
    elif format == "json":
        body = _unfence(text.strip())
        blocks = [body] if body.startswith("{") else []
    else:
        raise ValueError(f"unknown tool call format {format!r}: use one of {FORMATS}")
    calls = [_call(_unfence(block.strip())) for block in blocks[:MAX_CALLS_PER_ANSWER]]
    calls += [
        BadCall(f"at most {MAX_CALLS_PER_ANSWER} tool calls per answer")
        for _ in blocks[MAX_CALLS_PER_ANSWER:]
    ]
    return calls


def _unfence(text: str) -> str:
    match = _FENCE.match(text)
    return match.group(1) if match else text


def _call(body: str) -> ToolCall | BadCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        return BadCall(f"the tool call is not valid JSON ({error.msg} at character {error.pos})")
    if not isinstance(value, dict):
        return BadCall('a tool call is a JSON object: {"name": ..., "arguments": {...}}')
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return BadCall('the tool call has no "name" (a string)')
    # "parameters" is how Llama 3's templates spell it; arguments as a JSON string is OpenAI's
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return BadCall(f"the arguments of {name!r} are a string that is not JSON", name)
    if not isinstance(arguments, dict):
        return BadCall(f'the "arguments" of {name!r} must be a JSON object', name)
    return ToolCall(name, arguments)


def _written(call: str, format: ToolFormat) -> str:
    return f"<tool_call>{call}</tool_call>" if format == "hermes" else call


@dataclass(frozen=True)
class Outcome:
    """One call's answer for the model; valid: the call named a tool and fit its schema."""

    name: str | None
    text: str
    valid: bool


class Toolbox:
    """The run's tools by name: what the model is told about them, and each call checked
    against its tool's schema, then run."""

    def __init__(self, tools: Sequence[Tool]):
        self.tools = {tool.name: tool for tool in tools}
        if len(self.tools) != len(tools):
            names = [tool.name for tool in tools]
            twice = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(f"two tools are named {', '.join(twice)}: tool names must differ")
        self._validators = {
            tool.name: jsonschema.Draft202012Validator(tool.parameters) for tool in tools
        }

    @property
    def runs_code(self) -> bool:
        return any(tool.runs_code for tool in self.tools.values())

    def instructions(self, format: ToolFormat) -> str:
        """What the model is told before its task: the tools (their OpenAI declarations) and how
        to call one."""
        declarations = "\n".join(json.dumps(t.schema()) for t in self.tools.values())
        shape = '{"name": <tool name>, "arguments": <arguments object>}'
        if format == "hermes":
            how = f"To call a tool, write <tool_call>{shape}</tool_call>"
        else:
            how = f"To call a tool, answer with only the JSON object {shape}"
        sample = next((t for t in self.tools.values() if t.example is not None), None)
        if sample is not None:
            call = json.dumps({"name": sample.name, "arguments": dict(sample.example or {})})
            how += f", for example:\n{_written(call, format)}\n"
        else:
            how += "; "
        return (
            f"You may call these tools:\n<tools>\n{declarations}\n</tools>\n{how}The result "
            "comes back in the next message. When you know the answer, give it without a tool "
            "call."
        )

    @property
    def max_s(self) -> float:
        """The longest one call of any tool may take."""
        return max((tool.max_s for tool in self.tools.values()), default=0.0)

    def run(
        self, call: ToolCall | BadCall, context: ToolContext, deadline: float | None = None
    ) -> Outcome:
        """One call's outcome. deadline (time.monotonic()): a tool whose limit would run past
        it is not started, and the model is told so."""
        if isinstance(call, BadCall):
            return Outcome(call.name, f"error: {call.problem}", False)
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools)
            return Outcome(
                call.name, f"error: there is no tool {call.name!r} (tools: {known})", False
            )
        errors = sorted(self._validators[call.name].iter_errors(call.arguments), key=str)
        if errors:
            where = "/".join(str(p) for p in errors[0].absolute_path)
            at = f" at {where!r}" if where else ""
            return Outcome(
                call.name, f"error: bad arguments for {call.name!r}{at}: {errors[0].message}", False
            )
        if deadline is not None and tool.max_s > deadline - time.monotonic():
            return Outcome(
                call.name, f"error: no time left in this turn for {call.name}; try again", True
            )
        try:
            return Outcome(call.name, tool.run(call.arguments, context), True)
        except SandboxUnavailable:
            raise  # the host, not the model: the environment's fault handling decides
        except (ToolError, Refused) as error:
            return Outcome(call.name, f"error: {error}", True)
        except Exception as error:  # a tool's own bug is told to the model, not fatal
            return Outcome(
                call.name, f"error: {call.name} failed: {type(error).__name__}: {error}", True
            )
