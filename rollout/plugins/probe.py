"""Import plugins in a child process first, under a time limit, before planning imports them.

A plugin whose import hangs (a network call, a lock, an endless loop, a regex that backtracks
for hours in C code holding the GIL) would hang `rollout plan` with it, and no thread or signal
handler in the planning process could interrupt code that never releases the GIL. So each
plugin is first imported in one short-lived child interpreter, one after the other, each with
`timeout_s`; a hang or a crash (a segfault in an extension) becomes one Issue naming the plugin.
Exceptions are not reported here: the in-process import that follows reports them with the
plugin's own file and line.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rollout.errors import Issue

TIMEOUT_ENV = "ROLLOUT_PLUGIN_IMPORT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
_MARK = "@rollout-probe@"

# The child runs the standard library only (no rollout, no pydantic): it starts in ~30 ms.
_CHILD = r"""
import importlib, importlib.metadata, importlib.util, json, sys
MARK = "@rollout-probe@"
job = json.loads(sys.stdin.readline())
sys.path[:] = job["path"]
for i, (kind, target, group) in enumerate(job["plugins"]):
    print(MARK + json.dumps(["start", i]), flush=True)
    try:
        if kind == "file":
            spec = importlib.util.spec_from_file_location(f"_rollout_probe_{i}", target)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        elif kind == "module":
            importlib.import_module(target)
        else:
            for ep in importlib.metadata.entry_points(group=group, name=target):
                importlib.import_module(ep.module)
    except BaseException:
        pass
    print(MARK + json.dumps(["done", i]), flush=True)
"""


@dataclass(frozen=True)
class Probe:
    """One plugin to import: a .py file, a module, or an entry-point name in a group."""

    used_by: str
    ref: str
    kind: str  # "file", "module" or "entry_point"
    target: str
    group: str = ""


def import_timeout_s() -> float:
    """$ROLLOUT_PLUGIN_IMPORT_TIMEOUT_S, else 60 s."""
    try:
        return max(0.1, float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def probe_imports(probes: list[Probe], *, timeout_s: float | None = None) -> dict[str, Issue]:
    """Import each plugin in a child, in order; an Issue (by used_by) for each that hung or
    crashed the interpreter. Plugins after a hang or crash are probed in a fresh child."""
    timeout_s = import_timeout_s() if timeout_s is None else timeout_s
    issues: dict[str, Issue] = {}
    remaining = list(probes)
    while remaining:
        failed_at, issue = _probe_in_one_child(remaining, timeout_s)
        if failed_at is None:
            break
        issues[remaining[failed_at].used_by] = issue
        remaining = remaining[failed_at + 1 :]
    return issues


def _probe_in_one_child(probes: list[Probe], timeout_s: float) -> tuple[int | None, Issue | None]:
    job = {
        "path": [p or os.getcwd() for p in sys.path],
        "plugins": [[p.kind, p.target, p.group] for p in probes],
    }
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # killed as a group: a plugin may have started children
    )
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(json.dumps(job) + "\n")
    child.stdin.close()
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_read_lines, args=(child.stdout, lines), daemon=True).start()
    current, deadline = None, time.monotonic() + timeout_s
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:  # the plugin being imported took too long
                index = 0 if current is None else current
                return index, _hung(probes[index], timeout_s)
            if line is None:  # the child ended
                code = child.wait()
                if current is None or code == 0:
                    return None, None
                return current, _crashed(probes[current], code)
            event, index = json.loads(line)
            current = index if event == "start" else None
            deadline = time.monotonic() + timeout_s
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def _read_lines(stream, lines: queue.Queue[str | None]) -> None:
    """Our progress lines only: a plugin may print at import time too."""
    for line in stream:
        if line.startswith(_MARK):
            lines.put(line.removeprefix(_MARK))
    lines.put(None)


def _hung(probe: Probe, timeout_s: float) -> Issue:
    return Issue(
        probe.used_by,
        f"importing the plugin did not finish within {timeout_s:g} s: something at import time "
        "hangs or is very slow (a network call, a lock, an endless loop?)",
        value=probe.ref,
        hint=f"run `{_rerun(probe)}` to see where it stops; move slow work out of import time, "
        f"or raise the limit with {TIMEOUT_ENV}",
    )


def _crashed(probe: Probe, code: int) -> Issue:
    how = f"exit code {code}"
    if code < 0:
        try:
            how = f"signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"signal {-code}"
    return Issue(
        probe.used_by,
        f"importing the plugin killed the Python interpreter ({how})",
        value=probe.ref,
        hint=f"run `{_rerun(probe)}` to reproduce it",
    )


def _rerun(probe: Probe) -> str:
    if probe.kind == "file":
        return f"python {Path(probe.target)}"
    return f"python -c 'import {probe.target}'"
