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
_COLLECTIVE_TIMEOUT = re.compile(
    # gloo: "Timed out waiting 5000ms for recv operation to complete"; NCCL's watchdog:
    # "Watchdog caught collective operation timeout"
    r"Timed out waiting \d+ms for \w+ operation|collective operation timeout",
    re.IGNORECASE,
)


def error_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "errors" / f"rank-{rank}.txt"


def fault_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "errors" / f"rank-{rank}.fault"


def activity_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "workers" / f"rank-{rank}.json"


def describe_failure(
    run_dir: Path,
    returncode: int,
    torchrun_log: Path,
    *,
    roles: dict[int, str] | None = None,
    collective_timeout_s: float | None = None,
    torchrun_output: str | None = None,
) -> str:
    """The run's error: the first worker traceback if there is one (led, for a collective that
    timed out, by which rank waited where and where the others were), else which rank died how,
    at which step and inside which plugin. `roles` names each rank's roles; `torchrun_output` is
    this start's part of the log (the whole log if None)."""
    tracebacks = sorted((run_dir / "errors").glob("rank-*.txt"), key=lambda p: p.stat().st_mtime)
    if tracebacks:
        text = tracebacks[0].read_text(encoding="utf-8")
        message = f"{tracebacks[0].stem}: " + text
        if _COLLECTIVE_TIMEOUT.search(text):
            rank = int(tracebacks[0].stem.removeprefix("rank-"))
            message = _collective_timeout(run_dir, rank, roles or {}, collective_timeout_s) + (
                "\n" + message
            )
        return message
    output = torchrun_output if torchrun_output is not None else _read_text(torchrun_log)
    rank, exitcode = _torchrun_verdict(output)
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


def _collective_timeout(
    run_dir: Path, rank: int, roles: dict[int, str], timeout_s: float | None
) -> str:
    """Rank `rank` gave up waiting in a collective: say who waited where, and where every other
    rank this node can see was last (the stuck one is usually among them)."""
    limit = f"cluster.collective_timeout_s = {timeout_s:g} s" if timeout_s else "its timeout"
    header = (
        f"{_rank_at(run_dir, rank, roles)} waited longer than {limit} in a collective "
        "(gradient averaging, a gather, a barrier) for the other ranks: one of them is stuck, "
        "slow, or gone"
    )
    others = [
        _rank_at(run_dir, other, roles)
        for other in sorted(roles)
        if other != rank and activity_file(run_dir, other).exists()
    ]
    if others:
        header += ". Last seen: " + "; ".join(others)
    return header + (
        ". If a rank legitimately works alone that long, raise cluster.collective_timeout_s"
    )


def _rank_at(run_dir: Path, rank: int, roles: dict[int, str]) -> str:
    """'rank 1 (actor+learner) at step 3 inside reward 'slow' (...)', from its activity file."""
    text = f"rank {rank}"
    if rank in roles:
        text += f" ({roles[rank]})"
    activity = _read_json(activity_file(run_dir, rank)) or {}
    step = activity.get("step")
    text += f" at step {step}" if step is not None else " before its first step"
    if activity.get("inside"):
        text += f" inside {activity['inside']}"
    return text


def _torchrun_verdict(text: str) -> tuple[int | None, int | None]:
    """The first failed rank and its exit code, from torchrun's failure summary (which lists
    the other failures first, then the root cause: the first observed failure)."""
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
