"""Whether this host can dump and restore processes with CRIU (`snapshot.process = true`).

CRIU needs its binary, root (or CAP_CHECKPOINT_RESTORE), and a kernel whose features it knows;
`criu check` tests all of them and says which is missing. Hosts fail it for reasons no config can
fix: a container without the capability, or a vDSO layout CRIU cannot remap (seen on this
project's machines). The probe runs `criu check` and reports its first complaint; `rollout plan`
and `rollout run` refuse `snapshot.process = true` with it (rollout/planner/runnable.py), and
rollout/executor/criu.py asks again just before it dumps.
"""

from __future__ import annotations

import re
import shutil
import subprocess

CRIU = "criu"
CHECK_TIMEOUT_S = 30


def criu_problem() -> str | None:
    """Why CRIU cannot snapshot processes here, in words; None when `criu check` passes."""
    binary = shutil.which(CRIU)
    if binary is None:
        return "the criu binary is not installed (not found on PATH)"
    try:
        done = subprocess.run(
            [binary, "check"],
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"`criu check` did not answer within {CHECK_TIMEOUT_S} s"
    except OSError as error:
        return f"`criu check` cannot be started: {error.strerror or error}"
    if done.returncode == 0:
        return None
    return f"`criu check` fails here: {_complaint(done.stdout + done.stderr)}"


def _complaint(output: str) -> str:
    """CRIU's first telling error (it prints many), without its location prefixes.

    CRIU reports a failed helper first ("exited, status=1") and the cause after it ("vdso:
    Unexpected rt vDSO area bounds"): the generic lines are skipped while a specific one follows.
    """
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [message for line in lines if (message := _message(line))] or lines or ["no output"]
    telling = [line for line in errors if not _GENERIC.search(line)]
    first = (telling or errors)[0]
    return first if len(first) <= 200 else first[:197] + "..."


_GENERIC = re.compile(r"^exited, status=|^Could not initialize|failed when initializing")
_PREFIXES = re.compile(r"^(\(\d+\.\d+\)\s*)?(Error|Warn)\s*\([^)]*\):\s*")


def _message(line: str) -> str:
    """'(00.010) Error (criu/vdso.c:381): vdso: ...' -> 'vdso: ...' ('' for a line that is not
    an error or warning)."""
    line = line.strip()
    match = _PREFIXES.match(line)
    if match is None:
        return line if "error" in line.lower() else ""
    return line[match.end() :]
