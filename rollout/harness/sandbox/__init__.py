"""Sandboxes for tools that run model-written actions: Python code, an allow-listed shell, file
operations confined to an episode's directory, and HTTP with an egress allow-list; and the probe
that says what this host can enforce. See docs/sandbox.md."""

from rollout.harness.sandbox.files import Workspace
from rollout.harness.sandbox.http import HttpEgress, HttpResult
from rollout.harness.sandbox.probe import Capability, SandboxReport, probe_sandbox
from rollout.harness.sandbox.process import (
    Limits,
    Refused,
    RunResult,
    SandboxUnavailable,
    run_limited,
)
from rollout.harness.sandbox.python import PythonSandbox
from rollout.harness.sandbox.shell import ShellSandbox

__all__ = [
    "Capability",
    "HttpEgress",
    "HttpResult",
    "Limits",
    "PythonSandbox",
    "Refused",
    "RunResult",
    "SandboxReport",
    "SandboxUnavailable",
    "ShellSandbox",
    "Workspace",
    "probe_sandbox",
    "run_limited",
]
