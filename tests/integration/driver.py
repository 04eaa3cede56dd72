"""Driving the CLI as a user would, for the integration tests: in a subprocess, in a working
directory with a cache of its own, and looking for what it left running."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rollout.storage import open_store


def environment(workdir: Path) -> dict[str, str]:
    return {**os.environ, "ROLLOUT_CACHE": str(workdir / "cache"), "COLUMNS": "200"}


def rollout(
    workdir: Path, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`rollout ARGS` to its end, with `env` added to the environment. A command still running
    after `timeout` fails the test with every worker's stacks (where the run was waiting)."""
    with subprocess.Popen(
        [sys.executable, "-m", "rollout", *args],
        cwd=workdir,
        env={**environment(workdir), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = worker_stacks(workdir)
            process.kill()
            stdout, stderr = process.communicate()
            raise AssertionError(
                f"`rollout {' '.join(args)}` still running after {timeout:g} s\n"
                f"--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- worker stacks\n{stacks}"
            ) from None
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def worker_stacks(workdir: Path) -> str:
    """Ask every live worker started in `workdir` for its threads' stacks (SIGUSR1: each writes
    them to RUN_DIR/workers/rank-N.stacks and goes on), and return what they wrote."""
    for pid in _workers_in(workdir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(2)
    dumps = sorted(workdir.glob("runs/*/workers/rank-*.stacks"))
    return "\n".join(f"=== {path.relative_to(workdir)}\n{path.read_text()}" for path in dumps)


def _workers_in(workdir: Path) -> list[int]:
    """Pids of the rollout workers whose working directory is `workdir` (every process of a run
    inherits the directory `rollout` was started in)."""
    found, here = [], os.path.realpath(workdir)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            ours = "rollout.runtime.worker" in command and os.readlink(entry / "cwd") == here
            if ours and _catches_sigusr1(entry):  # else still starting: the signal would end it
                found.append(int(entry.name))
    return found


def _catches_sigusr1(proc: Path) -> bool:
    for line in (proc / "status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)
    return False


def plan_with(workdir: Path, config: str, *settings: str) -> Path:
    """`rollout plan` of `config` with each `--set` of `settings`, into workdir/plan.lock."""
    plan = workdir / "plan.lock"
    args = ["plan", "--config", config, "-o", str(plan)]
    for setting in settings:
        args += ["--set", setting]
    planned = rollout(workdir, *args)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    return plan


def start(workdir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`rollout ARGS` started in the background, its output captured."""
    return subprocess.Popen(
        [sys.executable, "-m", "rollout", *args],
        cwd=workdir,
        env={**environment(workdir), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def only_run(workdir: Path):
    store = open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False)
    (record,) = store.list_runs()
    return store, record


def processes_mentioning(marker: str) -> list[int]:
    """Pids of live processes (not zombies) whose command line mentions `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if marker in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                    found.append(int(entry.name))
    return found


# A reward plugin (written as examples/counting.py) that fails the run on its call FAIL_AFTER + 1:
# one call a step, so a run stops part-way at the same step every time, racing no signal.
COUNTING_REWARD = """
import glob
import os
import time


def counting(prompts, completions, **_):
    # Fails the run on call FAIL_AFTER + 1 (one call a step): a run stopped part-way, every time
    # at the same step, without racing a signal against the steps. With WAIT_FOR (a glob), the
    # failing call first waits for a file to match it: an actor running ahead of the learner
    # then fails only once the learner's checkpoint is committed.
    limit = os.environ.get("FAIL_AFTER")
    if limit is not None:
        path = os.environ["COUNT_FILE"]
        calls = int(open(path).read()) + 1 if os.path.exists(path) else 1
        open(path, "w").write(str(calls))
        if calls > int(limit):
            deadline = time.monotonic() + 120
            while os.environ.get("WAIT_FOR") and not glob.glob(os.environ["WAIT_FOR"]):
                if time.monotonic() > deadline:
                    raise RuntimeError("nothing matched %s" % os.environ["WAIT_FOR"])
                time.sleep(0.05)
            raise RuntimeError("stopped on purpose after %s calls" % limit)
    return [1.0 / (1 + len(c)) for c in completions]
"""
