"""Built-in rewards, against values computed by hand."""

from __future__ import annotations

import inspect
import math

import pytest

from rollout.harness.rewards import (
    BUILTIN_REWARDS,
    exact_match,
    length_penalty,
    numeric_match,
    regex_match,
)


def _prompts(n: int) -> list[str]:
    return ["q"] * n


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("The answer is 42.", 42, 1.0),
        ("The answer is 42.", "42", 1.0),
        ("first 7, then 41", 42, 0.0),  # the last number counts
        ("first 42, then 7", 42, 0.0),
        ("it drops to -5 degrees", -5, 1.0),
        ("from 3-5", 5, 1.0),  # a hyphen between numbers is not a minus sign
        ("x = 2.50", 2.5, 1.0),
        ("x = 2.5", "2.50", 1.0),
        ("0.1", 0.1, 1.0),  # compared as decimals, not binary floats
        ("total: 1,234 apples", 1234, 1.0),
        ("total: $1,234.50", "1234.5", 1.0),
        ("1234", "1,234", 1.0),
        ("no number here", 0, 0.0),
        ("", 1, 0.0),
        ("3", "Natalia sold 48/2 = 24 clips ... #### 3", 1.0),  # GSM8K-style answer text
        ("42", "no digits", 0.0),
        ("42", None, 0.0),
    ],
)
def test_numeric_match(completion, answer, expected):
    assert numeric_match(["q"], [completion], answer=[answer]) == [expected]


def test_numeric_match_tolerance_is_inclusive():
    completions = ["3.14", "3.2", "2.9"]
    answers = [3.1, 3.1, 3.1]
    assert numeric_match(_prompts(3), completions, answer=answers, tolerance=0.1) == [1.0, 1.0, 0.0]


def test_numeric_match_keeps_large_integers_exact():
    assert numeric_match(["q"], ["12345678901234567"], answer=[12345678901234568]) == [0.0]


def test_numeric_match_rejects_negative_tolerance():
    with pytest.raises(ValueError, match="tolerance"):
        numeric_match(["q"], ["1"], answer=[1], tolerance=-1)


def test_numeric_match_needs_one_answer_per_completion():
    with pytest.raises(ValueError):
        numeric_match(_prompts(2), ["1", "2"], answer=[1])


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("Paris", "paris", 1.0),
        ("  The   Eiffel\nTower. ", "the eiffel tower", 1.0),
        ("Paris!?", "Paris", 1.0),
        ("STRASSE", "straße", 1.0),  # casefold, not lower
        ("42", 42, 1.0),
        ("50%", "50", 0.0),  # only sentence punctuation is dropped
        ("Paris, France", "Paris", 0.0),
    ],
)
def test_exact_match(completion, answer, expected):
    assert exact_match(["q"], [completion], answer=[answer]) == [expected]


def test_regex_match_searches_unless_full():
    completions = ["<answer>7</answer>", "so <answer>7</answer>", "no tags"]
    pattern = r"<answer>\d+</answer>"
    assert regex_match(_prompts(3), completions, pattern=pattern) == [1.0, 1.0, 0.0]
    assert regex_match(_prompts(3), completions, pattern=pattern, full=True) == [1.0, 0.0, 0.0]


def test_length_penalty():
    completions = ["a" * 5, "a" * 10, "a" * 15, "a" * 30]
    # target 10, scale 0.5: -0.5 * max(0, len - 10) / 10
    assert length_penalty(_prompts(4), completions, target_chars=10, scale=0.5) == [
        0.0,
        0.0,
        -0.25,
        -1.0,
    ]
    assert length_penalty(["q"], ["a" * 12], target_chars=4) == [-2.0]


def test_length_penalty_within_target_is_positive_zero():
    (score,) = length_penalty(["q"], ["short"], target_chars=10)
    assert math.copysign(1.0, score) == 1.0


def test_length_penalty_rejects_non_positive_target():
    with pytest.raises(ValueError, match="target_chars"):
        length_penalty(["q"], ["a"], target_chars=0)


def test_registry_holds_every_builtin_under_its_own_name():
    assert sorted(BUILTIN_REWARDS) == [
        "code_tests",
        "exact_match",
        "length_penalty",
        "numeric_match",
        "regex_match",
    ]
    for name, fn in BUILTIN_REWARDS.items():
        assert fn.__name__ == name
        assert list(inspect.signature(fn).parameters)[:2] == ["prompts", "completions"]


def test_every_builtin_returns_floats():
    batch = (["q", "q"], ["1", "two"])
    results = [
        numeric_match(*batch, answer=[1, 2]),
        exact_match(*batch, answer=["1", "two"]),
        regex_match(*batch, pattern="o"),
        length_penalty(*batch, target_chars=1),
    ]
    for scores in results:
        assert len(scores) == 2
        assert all(type(score) is float for score in scores)
