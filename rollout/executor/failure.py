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
from dataclasses import dataclass
from pathlib import Path

# One failure of torchrun's summary: "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 7)".
_TORCHRUN_BLOCK = re.compile(
    r"^\s*rank\s*:\s*(\d+)[^\n]*(?:\n\s*exitcode\s*:\s*(-?\d+))?", re.MULTILINE
)
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


def stacks_file(run_dir: str | Path, rank: int) -> Path:
    """Where a live worker writes every thread's stack when sent SIGUSR1 (a run that seems hung:
    `kill -USR1 PID`, then read it); nothing the host reads as a failure."""
    return Path(run_dir) / "workers" / f"rank-{rank}.stacks"


@dataclass(frozen=True)
class Death:
    """The rank whose end ended this attempt of the run, as far as the host can tell."""

    rank: int
    exitcode: int | None
    """Its exit code (negative: the signal), from torchrun's summary; None if not listed."""
    traceback: Path | None
    """errors/rank-N.txt when it raised a Python exception; None when it died without one."""
    step: int | None
    """Its last step (its activity file), None before its first."""
    inside: str | None
    """The plugin code it was running, if any."""

    def how(self) -> str:
        """'from signal SIGKILL (exit code -9)', 'with exit code 3', 'raising an exception'."""
        if self.traceback is not None and (self.exitcode is None or self.exitcode >= 0):
            return "raising an exception"
        return _how(self.exitcode)

    def where(self) -> str:
        """' at step 3 inside reward ...', or '' when it had not begun a step."""
        text = f" at step {self.step}" if self.step is not None else ""
        return text + (f" inside {self.inside}" if self.inside else "")


def first_death(run_dir: Path, torchrun_output: str) -> Death | None:
    """Which rank ended the attempt: one that timed out in a collective, else the one killed by
    a signal (other than torchrun's own SIGTERM to the survivors) or exiting without a Python
    exception (a peer's death makes the
    other ranks raise, a connection closed in a collective; it never kills them), else the first
    to raise, else torchrun's root cause. None if no rank is known to have failed (torchrun
    itself did)."""
    failed = _torchrun_failures(torchrun_output)
    tracebacks = sorted((run_dir / "errors").glob("rank-*.txt"), key=lambda p: p.stat().st_mtime)
    raised = {int(path.stem.removeprefix("rank-")): path for path in tracebacks}
    # SIGTERM is how torchrun stops the other ranks once one failed: never the cause.
    silent = [r for r, code in failed.items() if r not in raised and code != -signal.SIGTERM]
    # A rank that waited past the collective timeout names the cause: its peers were alive but
    # stuck (in a plugin, say), and torchrun killed them afterwards (SIGKILL once they ignored
    # its SIGTERM), which would otherwise look like the first death.
    timed_out = [path for path in tracebacks if _COLLECTIVE_TIMEOUT.search(_read_text(path))]
    if timed_out:
        rank, traceback = int(timed_out[0].stem.removeprefix("rank-")), timed_out[0]
    elif silent:
        rank, traceback = silent[0], None
    elif tracebacks:
        rank, traceback = int(tracebacks[0].stem.removeprefix("rank-")), tracebacks[0]
    elif failed:
        rank, traceback = next(iter(failed)), None  # torchrun's root cause
    else:
        return None
    activity = _read_json(activity_file(run_dir, rank)) or {}
    return Death(rank, failed.get(rank), traceback, activity.get("step"), activity.get("inside"))


def describe_failure(
    run_dir: Path,
    returncode: int,
    torchrun_log: Path,
    *,
    roles: dict[int, str] | None = None,
    collective_timeout_s: float | None = None,
    torchrun_output: str | None = None,
) -> str:
    """The run's error: which rank died how, at which step and inside which plugin, when a
    rank died without a Python exception (with its faulthandler stack); else the first worker
    traceback (led, for a collective that timed out, by which rank waited where and where the
    others were). `roles` names each rank's roles; `torchrun_output` is this start's part of
    the log (the whole log if None)."""
    output = torchrun_output if torchrun_output is not None else _read_text(torchrun_log)
    death = first_death(run_dir, output)
    if death is None:
        return (
            f"torchrun exited with code {returncode} before any worker reported an error; "
            f"its output is in {torchrun_log}"
        )
    if death.traceback is not None:
        text = death.traceback.read_text(encoding="utf-8")
        message = f"{death.traceback.stem}: " + text
        if _COLLECTIVE_TIMEOUT.search(text):
            message = _collective_timeout(
                run_dir, death.rank, roles or {}, collective_timeout_s
            ) + ("\n" + message)
        return message
    message = (
        f"{rank_name(death.rank, roles)} died {death.how()}{death.where()} "
        f"(torchrun's output is in {torchrun_log})"
    )
    # faulthandler ends with the list of loaded extension modules: no help in finding the plugin.
    fault = _read_text(fault_file(run_dir, death.rank)).split("\nExtension modules:")[0]
    if fault.strip():
        message += "\n" + fault[-_FAULT_TAIL:]
    return message


def rank_name(rank: int, roles: dict[int, str] | None) -> str:
    """'rank 1 (learner)', or 'rank 1' when its roles are not known."""
    role = (roles or {}).get(rank)
    return f"rank {rank} ({role})" if role else f"rank {rank}"


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


def _torchrun_failures(text: str) -> dict[int, int | None]:
    """Every failed rank and its exit code, from torchrun's failure summary (which lists the
    other failures first, then the root cause: the first it observed), root cause first."""
    failures: dict[int, int | None] = {}
    root = text.rfind("Root Cause")
    for part in (text[root:], text[:root]) if root >= 0 else (text,):
        for block in _TORCHRUN_BLOCK.finditer(part):
            code = block.group(2)
            failures.setdefault(int(block.group(1)), int(code) if code is not None else None)
    return failures


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
