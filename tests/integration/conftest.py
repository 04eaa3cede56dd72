"""Integration fixtures: a working directory holding a copy of examples/ and test plugins."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES

LEARNABLE_REWARD = '''
def sevens(prompts, completions, **_):
    """The share of the completion's characters that are '7': a tiny model can learn that."""
    return [c.count("7") / max(1, len(c)) for c in completions]
'''


SLOW_REWARD = """
import time

def slow(prompts, completions, **_):
    time.sleep(0.3)  # keeps each step long enough for the test to kill the run mid-way
    return [0.0 for _ in completions]
"""


MARKED_REWARD = """
def marked(prompts, completions, **_):
    # 1 for one prompt, whatever the completion: the mean over any set of prompts is known.
    return [float(p.startswith("What is 8 + 12?")) for p in prompts]
"""


BROKEN_REWARD = """
def flaky(prompts, completions, **_):
    return [float("nan") if i == 2 else 0.0 for i, _ in enumerate(completions)]
"""


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    (tmp_path / "examples" / "sevens.py").write_text(LEARNABLE_REWARD)
    (tmp_path / "examples" / "flaky.py").write_text(BROKEN_REWARD)
    (tmp_path / "examples" / "slow.py").write_text(SLOW_REWARD)
    (tmp_path / "examples" / "marked.py").write_text(MARKED_REWARD)
    return tmp_path


@pytest.fixture(autouse=True)
def no_run_left_behind() -> Iterator[None]:
    """A test that fails while a `rollout` it started still runs must not leave it running (a run
    stuck in plugin code would spin for hours): after each test, SIGKILL this process's children
    that run `python -m rollout`; their own reaper then ends the rest of their runs."""
    yield
    for pid in _rollout_children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _rollout_children() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            stat = (entry / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().split(b"\0")
            if parent == os.getpid() and b"rollout" in command[1:3]:
                found.append(int(entry.name))
    return found
