"""Whether this host can dump and restore processes with CRIU (`snapshot.process = true`).

CRIU needs its binary, root (or CAP_CHECKPOINT_RESTORE), and a kernel whose features it knows;
`criu check` tests all of them and says which is missing. Hosts fail it for reasons no config can
fix: a container without the capability, or a vDSO layout CRIU cannot remap (seen on this
project's machines). The probe runs `criu check` and reports its first complaint; `rollout plan`
and `rollout run` refuse `snapshot.process = true` with it (rollout/planner/runnable.py), and
rollout/executor/criu.py asks again just before it dumps.
"""

from __future__ import annotations

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
    """CRIU's first error line (it prints many), without its timestamp prefix."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    first = (errors or lines or ["no output"])[0]
    if first.startswith("(") and ")" in first:  # "(00.010) Error (criu/...): ..."
        first = first.split(")", 1)[1].strip()
    return first if len(first) <= 200 else first[:197] + "..."
