"""The reward runner: fields and options in, checked scores out, every failure named."""

from __future__ import annotations

import math
import threading
import time

import pytest

from rollout.harness.reward_contract import RewardError, RewardFunction, describe
from rollout.harness.reward_runner import RewardRunner

PROMPTS = ["1 + 1?", "2 + 2?", "3 + 3?", "4 + 4?"]
COMPLETIONS = ["2", "5", "6", "It is 8, because four and four make eight, as everyone knows."]
ROWS = [{"answer": a, "level": lv} for a, lv in [("2", 1), ("4", 1), ("6", 2), ("8", 3)]]

# ---------------------------------------------------------------------------------------------
# plugins, as users write them


def exact(prompts, completions, *, answer):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def longer_than(prompts, completions, level, chars=1):
    """Takes the field ``level`` positionally-or-by-keyword, and an option."""
    return [float(len(c) > chars * lv) for c, lv in zip(completions, level, strict=True)]


def raises(prompts, completions):
    raise ValueError("unbalanced parenthesis in pattern")


def raises_timeout(prompts, completions):
    raise TimeoutError("the grading service did not answer")


def nan_at_2(prompts, completions):
    return [0.0, 1.0, math.nan, 0.0]


def three_values(prompts, completions):
    return [1.0, 1.0, 1.0]


def a_scalar(prompts, completions):
    return 1.0


def mutates_its_arguments(prompts, completions):
    scores = [0.0] * len(completions)
    completions.clear()
    return scores


def _runner(*functions: RewardFunction) -> RewardRunner:
    return RewardRunner(functions)


def _describe(name, fn, weight=1.0, options=None, timeout_s=5.0) -> RewardFunction:
    return describe(name, fn, weight, options or {}, timeout_s)


def _failure(fn, name="plugin") -> RewardError:
    with pytest.raises(RewardError) as caught:
        _runner(_describe(name, fn)).score(PROMPTS, COMPLETIONS, ROWS)
    return caught.value


# ---------------------------------------------------------------------------------------------
# calling


def test_describe_reads_the_keywords_a_function_names():
    assert _describe("exact", exact).accepts == frozenset({"answer"})
    assert _describe("longer", longer_than).accepts == frozenset({"level", "chars"})
    assert _describe("any", lambda prompts, completions, **kwargs: []).accepts is None


def test_weights_combine_into_the_total():
    # exact:        [1, 0, 1, 0]            weight 2
    # longer_than:  len > 1 × level: "2" 1 > 1 no, "5" no, "6" 1 > 2 no, the sentence yes
    #               → [0, 0, 0, 1]          weight -0.5
    # total = 2 × exact - 0.5 × longer = [2, 0, 2, -0.5]
    runner = _runner(_describe("exact", exact, 2.0), _describe("longer", longer_than, -0.5))
    scores = runner.score(PROMPTS, COMPLETIONS, ROWS)
    assert scores.per_function == {"exact": [1.0, 0.0, 1.0, 0.0], "longer": [0.0, 0.0, 0.0, 1.0]}
    assert scores.total == [2.0, 0.0, 2.0, -0.5]


def test_a_named_parameter_function_gets_only_its_fields_plus_its_options():
    # chars = 3: len > 3 × level only for the sentence. Were "answer" passed too, the call
    # would fail with "unexpected keyword argument".
    runner = _runner(_describe("longer", longer_than, options={"chars": 3}))
    assert runner.score(PROMPTS, COMPLETIONS, ROWS).total == [0.0, 0.0, 0.0, 1.0]


def test_a_kwargs_function_gets_every_field_and_its_options():
    seen = []

    def everything(prompts, completions, **kwargs):
        seen.append(kwargs)
        return [0.0] * len(completions)

    _runner(_describe("all", everything, options={"strict": True})).score(
        PROMPTS, COMPLETIONS, ROWS
    )
    assert seen == [{"answer": ["2", "4", "6", "8"], "level": [1, 1, 2, 3], "strict": True}]


def test_an_option_wins_over_a_field_of_the_same_name():
    runner = _runner(_describe("exact", exact, options={"answer": ["2", "5", "x", "x"]}))
    assert runner.score(PROMPTS, COMPLETIONS, ROWS).total == [1.0, 1.0, 0.0, 0.0]


def test_a_plugin_that_mutates_its_arguments_does_not_change_what_the_next_one_sees():
    runner = _runner(_describe("mutates", mutates_its_arguments), _describe("exact", exact))
    assert runner.score(PROMPTS, COMPLETIONS, ROWS).per_function["exact"] == [1.0, 0.0, 1.0, 0.0]


# ---------------------------------------------------------------------------------------------
# failures


def test_a_raising_plugin_is_named_with_the_exception_and_its_line():
    error = _failure(raises, name="pattern")
    line = raises.__code__.co_firstlineno + 1
    assert error.reward == "pattern" and error.sample is None
    assert "reward 'pattern' raised ValueError: unbalanced parenthesis in pattern" in str(error)
    assert f"{__file__}:{line}" in str(error)
    assert isinstance(error.__cause__, ValueError)


def test_a_plugins_own_timeout_error_is_reported_as_raised_not_as_a_time_out():
    error = _failure(raises_timeout)
    assert "raised TimeoutError: the grading service did not answer" in str(error)


def test_a_plugin_past_its_timeout_is_stopped_waiting_for():
    release = threading.Event()

    def hangs(prompts, completions):
        release.wait(timeout=10)
        return [0.0] * len(completions)

    runner = _runner(_describe("hangs", hangs, timeout_s=0.2))
    started = time.monotonic()
    try:
        with pytest.raises(RewardError, match=r"'hangs' did not return within 0\.2 s for 4 comp"):
            runner.score(PROMPTS, COMPLETIONS, ROWS)
        assert time.monotonic() - started < 1.0
    finally:
        release.set()


def test_nan_is_reported_with_its_sample_and_completion():
    error = _failure(nan_at_2, name="judge")
    assert error.reward == "judge" and error.sample == 2
    assert "reward 'judge' returned nan for sample 2 (completion '6')" in str(error)


def test_a_wrong_count_is_never_broadcast():
    error = _failure(three_values)
    assert "returned 3 values for 4 completions" in str(error)


def test_a_non_sequence_is_refused():
    assert "returned float, not a list" in str(_failure(a_scalar))
    assert "returned str, not a list" in str(_failure(lambda prompts, completions: "1111"))


@pytest.mark.parametrize(
    ("bad", "said"),
    [(None, "None"), (math.inf, "inf"), ("1.0", "str '1.0'"), (True, "bool True")],
)
def test_a_value_that_is_not_a_finite_number_is_refused(bad, said):
    def one_bad(prompts, completions):
        return [0.0, 0.0, 0.0, bad]

    error = _failure(one_bad)
    assert error.sample == 3
    assert f"returned {said} for sample 3" in str(error)
    # The long completion is quoted shortened: its first 59 characters and an ellipsis.
    quoted = COMPLETIONS[3][:59] + "…"
    assert f"(completion {quoted!r})" in str(error)


def test_functions_run_in_order_and_the_first_failure_stops_the_batch():
    calls = []

    def recorded(prompts, completions):
        calls.append("recorded")
        return [0.0] * len(completions)

    runner = _runner(_describe("first", raises), _describe("second", recorded))
    with pytest.raises(RewardError, match="'first'"):
        runner.score(PROMPTS, COMPLETIONS, ROWS)
    assert calls == []


def test_the_batch_itself_must_line_up():
    runner = _runner(_describe("exact", exact))
    with pytest.raises(ValueError, match="one entry per completion"):
        runner.score(PROMPTS, COMPLETIONS[:3], ROWS)
    with pytest.raises(ValueError, match="row 1 has fields"):
        runner.score(PROMPTS, COMPLETIONS, [ROWS[0], {"answer": "4"}, *ROWS[2:]])


def test_reward_names_must_be_unique():
    with pytest.raises(ValueError, match="repeated: exact"):
        _runner(_describe("exact", exact), _describe("exact", nan_at_2))
