"""Agent programs: any code written against the OpenAI client, run once per episode.

The harness starts the program with the episode's base URL in OPENAI_BASE_URL (rollout's own
server, which records every completion it serves for that episode), a key in OPENAI_API_KEY, and
the episode's task (its dataset row, as JSON) in ROLLOUT_TASK. Whatever the program prints last
on stdout (its last non-empty line) is its final answer, which the run's [[rewards]] score.

Each program runs in a session of its own with a working directory of its own, under a
wall-clock limit and an output cap; when it ends, for whatever reason, its whole process group is
killed, so nothing it started outlives the episode. Agent programs are the user's code, trusted as
reward plugins are: they are contained (time, output, processes), not sandboxed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FINAL_ANSWER_CHARS = 4096
"""The final answer is cut to this many characters (its end kept)."""
_POLL_S = 0.05
# Variables an agent must not inherit: credentials of the run's own services.
_WITHHELD = ("ROLLOUT_PG_DSN", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "OPENAI_API_KEY")


AGENT = "agent"
"""The built-in environment whose episodes are agent programs ([environment] name = "agent")."""


@dataclass(frozen=True)
class AgentSpec:
    """The agent environment's options, checked: `command` runs one episode (a list of
    arguments, or one string split as a shell would, never run by one); `concurrency` episodes
    run at once."""

    command: Sequence[str] | str
    concurrency: int = 16

    def __post_init__(self) -> None:
        if not argv_of(self.command) or not all(isinstance(a, str) for a in argv_of(self.command)):
            raise ValueError("agent: command must be a non-empty string or list of strings")
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int):
            raise TypeError(f"agent: concurrency must be an integer, got {self.concurrency!r}")
        if not 1 <= self.concurrency <= 1024:
            raise ValueError(f"agent: concurrency must be 1 to 1024, got {self.concurrency}")

    @property
    def argv(self) -> tuple[str, ...]:
        return argv_of(self.command)


@dataclass(frozen=True)
class AgentOutcome:
    answer: str
    """The last non-empty line of stdout ('' when there is none)."""
    failure: str | None
    """Why the episode failed (timeout, output flood, a non-zero exit), else None."""
    stderr_tail: str
    seconds: float


@dataclass(frozen=True)
class AgentProgram:
    argv: tuple[str, ...]
    cwd: Path
    """Where relative paths in argv are resolved (the config's directory)."""
    timeout_s: float
    max_output_bytes: int = 1 << 20

    def run(
        self, *, base_url: str, api_key: str, task: Mapping[str, Any], episode_id: str
    ) -> AgentOutcome:
        """One episode: start the program, wait for it (or its limit), kill its group."""
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"rollout-agent-{episode_id}-") as scratch:
            out_path, err_path = Path(scratch) / "stdout", Path(scratch) / "stderr"
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                process = subprocess.Popen(
                    list(self.argv),
                    cwd=self.cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    env=self._environment(base_url, api_key, task, episode_id, scratch),
                    start_new_session=True,  # its own process group: one kill takes it all
                )
                try:
                    failure = self._wait(process, started, out_path, err_path)
                finally:
                    _kill_group(process)
            answer = _last_line(_tail(out_path, FINAL_ANSWER_CHARS * 4))
            stderr_tail = _tail(err_path, 2000)
        if failure is None and process.returncode != 0:
            failure = f"the agent exited with code {process.returncode}: {stderr_tail[-300:]}"
        return AgentOutcome(answer, failure, stderr_tail, time.monotonic() - started)

    def _wait(self, process: subprocess.Popen, started: float, *outputs: Path) -> str | None:
        while process.poll() is None:
            if time.monotonic() - started > self.timeout_s:
                return f"the agent did not finish within {self.timeout_s:g} s"
            if sum(path.stat().st_size for path in outputs) > self.max_output_bytes:
                return f"the agent wrote more than {self.max_output_bytes} bytes of output"
            time.sleep(_POLL_S)
        return None

    def _environment(
        self,
        base_url: str,
        api_key: str,
        task: Mapping[str, Any],
        episode_id: str,
        scratch: str,
    ) -> dict[str, str]:
        inherited = {k: v for k, v in os.environ.items() if k not in _WITHHELD}
        return {
            **inherited,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": api_key,
            "ROLLOUT_TASK": json.dumps(dict(task), default=str),
            "ROLLOUT_EPISODE_ID": episode_id,
            "TMPDIR": scratch,
        }


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def _tail(path: Path, size: int) -> str:
    with open(path, "rb") as handle:
        handle.seek(max(0, path.stat().st_size - size))
        return handle.read().decode("utf-8", errors="replace")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][-FINAL_ANSWER_CHARS:] if lines else ""


def argv_of(command: Sequence[str] | str) -> tuple[str, ...]:
    """A command as configured: a list of arguments, or one string split like a shell would
    (without running one). `python` (or `python3`) is the Python running rollout, so an agent
    finds the packages installed beside it (the openai client)."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return tuple(argv)


def missing_program(argv: Sequence[str], cwd: Path) -> str | None:
    """What of the command cannot be found (its program, or the script a Python runs), for
    the plan to refuse; None when both are there."""
    if not argv:
        return "the command is empty"
    program = argv[0]
    if "/" in program:
        if not (cwd / program).is_file():
            return f"no program {program} (relative to {cwd})"
    elif shutil.which(program) is None:
        return f"no program {program!r} on PATH"
    script = argv[1] if len(argv) > 1 and argv[1].endswith(".py") else None
    if Path(program).name.startswith("python") and script and not (cwd / script).is_file():
        return f"no script {script} (relative to {cwd})"
    return None
