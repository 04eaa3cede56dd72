"""The code_tests reward: real sandboxed interpreters, one per completion, with short limits."""

from __future__ import annotations

import time

import pytest

from rollout.harness.code_tests import code_tests, extract_code
from rollout.harness.reward_contract import runs_model_code
from rollout.harness.rewards import BUILTIN_REWARDS, numeric_match

TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"
RIGHT = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
CRASHES = "```python\ndef add(a, b):\n    return undefined_name\n```"
HANGS = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
EXITS_EARLY = "```python\nimport sys\nsys.exit(0)\n```"  # skips the tests: must not pass


def score(completions: list[str], tests: object = TESTS, **options: object) -> list[float]:
    options.setdefault("timeout_s", 2.0)
    return code_tests(
        ["p"] * len(completions), completions, tests=[tests] * len(completions), **options
    )


def test_scores_right_wrong_crashing_hanging_and_early_exit():
    assert score([RIGHT, WRONG, CRASHES, HANGS, EXITS_EARLY]) == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_bare_code_without_a_fence_is_run_as_it_is():
    assert score(["def add(a, b):\n    return a + b\n"]) == [1.0]
    assert score(["def add(a, b): return a * b"]) == [0.0]


def test_the_last_python_block_is_the_code():
    draft_then_fix = WRONG + "\nOops, fixed:\n" + RIGHT
    assert extract_code(draft_then_fix) == "def add(a, b):\n    return a + b\n"
    assert score([draft_then_fix, RIGHT + "\nor:\n" + WRONG]) == [1.0, 0.0]


def test_tests_may_be_a_list_of_lines():
    assert score([RIGHT], tests=TESTS.splitlines()) == [1.0]


def test_memory_past_the_limit_fails_the_tests():
    greedy = "block = bytearray(400 * 2**20)\n" + RIGHT.split("```python\n")[1].split("```")[0]
    assert score([greedy], memory_mb=128) == [0.0]
    assert score([greedy], memory_mb=1024) == [1.0]


def test_a_batch_runs_side_by_side():
    started = time.monotonic()
    assert score([HANGS] * 4 + [RIGHT], timeout_s=2.0) == [0.0] * 4 + [1.0]
    # One after another, four programs that run to their 2 s limit would take 8 s at least.
    assert time.monotonic() - started < 7.5


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"memory_mb": 0}, "memory_mb"),
        ({"memory_mb": 1.5}, "memory_mb"),
    ],
)
def test_bad_limits_are_refused(options, says):
    with pytest.raises(ValueError, match=says):
        score([RIGHT], **options)


def test_tests_that_are_not_source_are_refused():
    with pytest.raises(TypeError, match="tests field of sample 0"):
        score([RIGHT], tests={"assert": 1})


def test_it_is_a_builtin_that_declares_it_runs_model_code():
    assert BUILTIN_REWARDS["code_tests"] is code_tests
    assert runs_model_code(code_tests) and not runs_model_code(numeric_match)
