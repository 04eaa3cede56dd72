"""Planning imports each plugin in a child process first, under a time limit: an import that
hangs (even in C code holding the GIL) or kills the interpreter is one clear Issue, in seconds."""

from __future__ import annotations

import time

import pytest

from rollout.errors import PlanError
from rollout.planner.builder import build_plan
from rollout.plugins.probe import Probe, probe_imports

GIL_BOUND_HANG = """
import re
re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking in C: hours, GIL held
def score(prompts, completions, **_):
    return [0.0 for _ in completions]
"""
SEGFAULT = """
import ctypes
ctypes.string_at(0)
"""
CHATTY = """
print('["done", 0]')  # a plugin printing at import time must not confuse the probe
def score(prompts, completions, **_):
    return [0.0 for _ in completions]
"""


def file_probe(tmp_path, name, source, index):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return Probe(f"rewards[{index}].fn", f"./{name}.py:score", "file", str(path))


def test_a_hang_and_a_crash_are_named_and_the_rest_are_probed(tmp_path):
    probes = [
        file_probe(tmp_path, "hangs", GIL_BOUND_HANG, 0),
        file_probe(tmp_path, "chatty", CHATTY, 1),
        file_probe(tmp_path, "crashes", SEGFAULT, 2),
        Probe("rewards[3].fn", "json:loads", "module", "json"),
    ]
    started = time.monotonic()
    issues = probe_imports(probes, timeout_s=1.0)
    assert time.monotonic() - started < 20
    assert sorted(issues) == ["rewards[0].fn", "rewards[2].fn"]
    assert "did not finish within 1 s" in issues["rewards[0].fn"].message
    assert "python " in issues["rewards[0].fn"].hint and "hangs.py" in issues["rewards[0].fn"].hint
    assert "signal SIGSEGV" in issues["rewards[2].fn"].message


def test_an_exception_at_import_is_left_to_the_in_process_import(tmp_path):
    probe = file_probe(tmp_path, "raises", "raise ValueError('bad plugin')\n", 0)
    assert probe_imports([probe], timeout_s=5.0) == {}


def test_planning_refuses_a_plugin_whose_import_hangs(
    config_file, base_config, monkeypatch, tmp_path
):
    monkeypatch.setenv("ROLLOUT_PLUGIN_IMPORT_TIMEOUT_S", "1")
    (tmp_path / "hangs.py").write_text(GIL_BOUND_HANG)
    base_config["rewards"] = [{"fn": "numeric_match"}, {"fn": "./hangs.py:score"}]
    with pytest.raises(PlanError) as caught:
        build_plan(config_file(base_config))
    (issue,) = caught.value.issues
    assert issue.path == "rewards[1].fn" and "did not finish within 1 s" in issue.message
