"""Driving the CLI as a user would, for the integration tests: in a subprocess, in a working
directory with a cache of its own, and looking for what it left running."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from rollout.storage import open_store


def environment(workdir: Path) -> dict[str, str]:
    return {**os.environ, "ROLLOUT_CACHE": str(workdir / "cache"), "COLUMNS": "200"}


def rollout(
    workdir: Path, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`rollout ARGS` to its end, with `env` added to the environment."""
    return subprocess.run(
        [sys.executable, "-m", "rollout", *args],
        cwd=workdir,
        env={**environment(workdir), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


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
