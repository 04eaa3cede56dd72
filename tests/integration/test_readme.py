"""The README's code works exactly as written: its config, validated and planned, and its Python
example run as a script against that config (which trains the tiny model for real)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, REPO
from tests.integration.driver import environment

FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(language: str) -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return [body for lang, body in FENCE.findall(text) if lang == language]


def test_the_readme_has_one_config_and_one_python_example():
    assert len(blocks("toml")) == 1 and len(blocks("python")) == 1


@pytest.mark.slow
def test_the_readme_python_example_runs_against_the_readme_config(tmp_path: Path):
    shutil.copytree(EXAMPLES / "data", tmp_path / "data")
    (tmp_path / "run.toml").write_text(blocks("toml")[0], encoding="utf-8")
    (tmp_path / "example.py").write_text(blocks("python")[0], encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        env=environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "finished 5"
    assert (tmp_path / "plan.lock").is_file()
