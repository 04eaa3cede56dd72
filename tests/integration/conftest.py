"""Integration fixtures: a working directory holding a copy of examples/ and test plugins."""

from __future__ import annotations

import shutil
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
