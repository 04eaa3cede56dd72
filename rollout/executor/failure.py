"""Why a run failed, in one message: from what its workers left in the run directory.

Workers report through files the host reads after they end (their one contract with the host):

    errors/rank-N.txt     the traceback of a Python exception that ended rank N
    errors/rank-N.fault   faulthandler's dump of every thread's stack, when a fatal signal
                          (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) ended rank N
    workers/rank-N.json   rank N's last step and the plugin code it was running

A worker that died without an exception (os._exit in a plugin, a segfault, the OOM killer)
leaves only the last two; torchrun's own log then gives its exit code or signal.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
from pathlib import Path

_TORCHRUN_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.MULTILINE)
_TORCHRUN_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)
_FAULT_TAIL = 4000


def error_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "errors" / f"rank-{rank}.txt"


def fault_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "errors" / f"rank-{rank}.fault"


def activity_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "workers" / f"rank-{rank}.json"


def describe_failure(run_dir: Path, returncode: int, torchrun_log: Path) -> str:
    """The run's error: the first worker traceback if there is one, else which rank died how,
    at which step and inside which plugin."""
    tracebacks = sorted((run_dir / "errors").glob("rank-*.txt"), key=lambda p: p.stat().st_mtime)
    if tracebacks:
        return f"{tracebacks[0].stem}: " + tracebacks[0].read_text(encoding="utf-8")
    rank, exitcode = _torchrun_verdict(torchrun_log)
    if rank is None:
        return (
            f"torchrun exited with code {returncode} before any worker reported an error; "
            f"its output is in {torchrun_log}"
        )
    parts = [f"rank {rank} died {_how(exitcode)}"]
    activity = _read_json(activity_file(run_dir, rank))
    if activity and activity.get("step") is not None:
        parts.append(f"at step {activity['step']}")
    if activity and activity.get("inside"):
        parts.append(f"inside {activity['inside']}")
    message = " ".join(parts) + f" (torchrun's output is in {torchrun_log})"
    # faulthandler ends with the list of loaded extension modules: no help in finding the plugin.
    fault = _read_text(fault_file(run_dir, rank)).split("\nExtension modules:")[0]
    if fault.strip():
        message += "\n" + fault[-_FAULT_TAIL:]
    return message


def _torchrun_verdict(log: Path) -> tuple[int | None, int | None]:
    """The first failed rank and its exit code, from torchrun's failure summary (which lists
    the other failures first, then the root cause: the first observed failure)."""
    text = _read_text(log)
    text = text[text.rfind("Root Cause") :] if "Root Cause" in text else text
    rank = _TORCHRUN_RANK.search(text)
    code = _TORCHRUN_EXIT.search(text)
    return (int(rank.group(1)) if rank else None, int(code.group(1)) if code else None)


def _how(exitcode: int | None) -> str:
    if exitcode is None:
        return "(exit status unknown)"
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"from signal {signal.Signals(-exitcode).name} (exit code {exitcode})"
        return f"from signal {-exitcode}"
    return f"with exit code {exitcode}"


def _read_text(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(encoding="utf-8", errors="replace")
    return ""


def _read_json(path: Path) -> dict | None:
    with contextlib.suppress(ValueError):
        value = json.loads(_read_text(path) or "null")
        return value if isinstance(value, dict) else None
    return None
