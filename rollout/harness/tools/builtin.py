"""The built-in tools besides the calculator: Python code and an allow-listed shell in the
process sandbox, file operations confined to the episode's directory, and HTTP GET through the
egress allow-list. Each is built by a factory called with the tool's options (so a bad option
fails when the plan builds it) and returns a Tool. See docs/tools.md."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout.harness.sandbox import (
    HttpEgress,
    Limits,
    PythonSandbox,
    RunResult,
    ShellSandbox,
    Workspace,
)
from rollout.harness.tools.base import Tool, ToolContext
from rollout.harness.tools.calculator import calculator


def _limits(wall_s: float, cpu_s: int, memory_mb: int, processes: int) -> Limits:
    return Limits(cpu_s=cpu_s, memory_bytes=memory_mb * 2**20, processes=processes, wall_s=wall_s)


def _report(result: RunResult, max_chars: int) -> str:
    """A sandboxed program's outcome as the model reads it: its output, then how it ended
    when that is not a plain success."""
    parts = [result.stdout.rstrip()] if result.stdout.strip() else []
    if result.stderr.strip():
        parts.append("stderr:\n" + result.stderr.rstrip())
    if result.failure is not None:
        parts.append(f"stopped: {result.failure}")
    elif result.exit_code != 0:
        parts.append(f"exit code {result.exit_code}")
    text = "\n".join(parts) or "(no output)"
    return text if len(text) <= max_chars else text[:max_chars] + "\n[output cut]"


def python(
    *,
    wall_s: float = 10.0,
    cpu_s: int = 5,
    memory_mb: int = 512,
    processes: int = 16,
    max_output_chars: int = 4000,
) -> Tool:
    """`python`: run code in a fresh sandboxed interpreter; its printed output is the answer."""
    limits = _limits(wall_s, cpu_s, memory_mb, processes)

    def run(arguments: dict[str, Any], context: ToolContext) -> str:
        sandbox = PythonSandbox(
            context.workdir,
            limits,
            require_network_isolation=context.require_network_isolation,
        )
        return _report(sandbox.run(arguments["code"]), max_output_chars)

    return Tool(
        "python",
        "Run a Python program (standard library only, no network) and return what it prints. "
        "Files it writes stay in your working directory for later calls.",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program"}},
            "required": ["code"],
            "additionalProperties": False,
        },
        run,
        runs_code=True,
        example={"code": "print(2 ** 10)"},
        max_s=wall_s,
    )


def shell(
    *,
    allowed: list[str],
    wall_s: float = 10.0,
    cpu_s: int = 5,
    memory_mb: int = 512,
    processes: int = 16,
    max_output_chars: int = 4000,
) -> Tool:
    """`shell`: one command whose program is on `allowed` (no pipes, globs or redirections)."""
    if not allowed:
        raise ValueError("shell: options.allowed must name at least one program, e.g. ['ls']")
    limits = _limits(wall_s, cpu_s, memory_mb, processes)
    ShellSandbox(".", allowed, limits)  # checks the names now: bare program names only

    def run(arguments: dict[str, Any], context: ToolContext) -> str:
        sandbox = ShellSandbox(
            context.workdir,
            allowed,
            limits,
            require_network_isolation=context.require_network_isolation,
        )
        return _report(sandbox.run(arguments["command"]), max_output_chars)

    return Tool(
        "shell",
        f"Run one command in your working directory; allowed programs: {', '.join(allowed)}. "
        "No pipes, redirections or globs.",
        {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "e.g. 'ls -l'"}},
            "required": ["command"],
            "additionalProperties": False,
        },
        run,
        runs_code=True,
        example={"command": allowed[0]},
        max_s=wall_s,
    )


def _path_parameter(description: str) -> dict[str, Any]:
    return {"type": "string", "description": description}


def read_file(*, max_bytes: int = 1 << 16) -> Tool:
    def run(arguments: dict[str, Any], context: ToolContext) -> str:
        return Workspace(context.workdir, max_read_bytes=max_bytes).read(arguments["path"])

    return Tool(
        "read_file",
        "Read a text file from your working directory.",
        {
            "type": "object",
            "properties": {"path": _path_parameter("relative to your working directory")},
            "required": ["path"],
            "additionalProperties": False,
        },
        run,
        example={"path": "notes.txt"},
    )


def write_file(*, max_bytes: int = 1 << 16) -> Tool:
    def run(arguments: dict[str, Any], context: ToolContext) -> str:
        written = Workspace(context.workdir, max_write_bytes=max_bytes).write(
            arguments["path"], arguments["content"]
        )
        return f"wrote {written} bytes to {arguments['path']}"

    return Tool(
        "write_file",
        "Write a text file in your working directory (replacing it if it exists).",
        {
            "type": "object",
            "properties": {
                "path": _path_parameter("relative to your working directory"),
                "content": {"type": "string"},
            },
            "required": ["path", "content"],
            "additionalProperties": False,
        },
        run,
    )


def list_files() -> Tool:
    def run(arguments: dict[str, Any], context: ToolContext) -> str:
        names = Workspace(context.workdir).list(arguments.get("path", "."))
        return "\n".join(names) if names else "(empty)"

    return Tool(
        "list_files",
        "List the files in a directory of your working directory.",
        {
            "type": "object",
            "properties": {"path": _path_parameter("a directory; '.' by default")},
            "additionalProperties": False,
        },
        run,
        example={"path": "."},
    )


def http_get(*, allowed_hosts: list[str], timeout_s: float = 10.0, max_chars: int = 4000) -> Tool:
    """`http_get`: fetch a URL whose host is on `allowed_hosts` (exact, or '*.domain')."""
    if not allowed_hosts:
        raise ValueError("http_get: options.allowed_hosts must name at least one host")
    redirects = 2
    egress = HttpEgress(
        allowed_hosts,
        timeout_s=timeout_s,
        max_response_bytes=4 * max_chars,
        max_redirects=redirects,
    )

    def run(arguments: dict[str, Any], context: ToolContext) -> str:
        result = egress.get(arguments["url"])
        if result.failure is not None:
            return f"request failed: {result.failure}"
        text = result.text
        cut = "\n[response cut]" if result.truncated or len(text) > max_chars else ""
        return f"status {result.status}\n{text[:max_chars]}{cut}"

    return Tool(
        "http_get",
        f"Fetch a web page by URL (hosts allowed: {', '.join(allowed_hosts)}).",
        {
            "type": "object",
            "properties": {"url": {"type": "string", "description": "http:// or https:// URL"}},
            "required": ["url"],
            "additionalProperties": False,
        },
        run,
        max_s=timeout_s * (redirects + 1),  # each request of a redirect chain has timeout_s
    )


BUILTIN_TOOLS: dict[str, Callable[..., Tool]] = {
    "calculator": calculator,
    "python": python,
    "shell": shell,
    "read_file": read_file,
    "write_file": write_file,
    "list_files": list_files,
    "http_get": http_get,
}
"""Built-in tools by name, each a factory called with the tool's options."""
