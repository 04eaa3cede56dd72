"""One bad sample does not sink its batch: a reward in a sidecar that hangs, crashes or raises on
a batch is bisected down to the samples it fails on alone (rollout.harness.isolate), and its
on_error decides what those cost. Real child processes, deadlines of about a second."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

from rollout.harness.isolate import isolate, isolation_budget_s
from rollout.harness.reward_contract import RewardError, describe
from rollout.harness.reward_runner import RewardRunner
from rollout.plugins.resolve import resolve_plugin
from rollout.plugins.sidecar.host import SidecarCallable, SidecarHost, server_argv

PLUGINS = """
import os
import re
import signal
import sys
from pathlib import Path

PIDS = Path(__file__).with_name("pids")


def _score(completion, answer):
    PIDS.open("a").write(f"{os.getpid()}\\n")
    return float(len(completion)) + (1.0 if completion.endswith(answer) else 0.0)


def hangs_on_bad(prompts, completions, answer):
    for completion in completions:
        if "BAD" in completion:
            re.match(r"(a+)+$", "a" * 40 + "b")  # hours in C, holding the GIL
    return [_score(c, a) for c, a in zip(completions, answer)]


def segfaults_on_bad(prompts, completions, answer):
    for completion in completions:
        if "BAD" in completion:
            print(f"scoring {completion!r}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGSEGV)
    return [_score(c, a) for c, a in zip(completions, answer)]


def raises_on_bad(prompts, completions, answer):
    for completion in completions:
        if "BAD" in completion:
            raise ValueError(f"cannot parse {completion!r}")
    return [_score(c, a) for c, a in zip(completions, answer)]
"""

BAD = 5
PROMPTS = [f"Question {i}: what is {i} + {i}? Answer with the number only." for i in range(8)]
COMPLETIONS = [f"{i} + {i} = {2 * i}" for i in range(8)]
COMPLETIONS[BAD] = "BAD " + "a" * 40
ROWS = [{"answer": str(2 * i)} for i in range(8)]
TIMEOUT_S = 1.0


@pytest.fixture
def plugin_file(tmp_path: Path) -> Path:
    path = tmp_path / "plugins.py"
    path.write_text(PLUGINS)
    return path


@pytest.fixture
def runner_for(plugin_file):
    """A RewardRunner over one plugin of PLUGINS in a sidecar; every sidecar it started (each
    pid a child wrote) is checked dead after the test."""
    made = []

    def make(name: str, **policy) -> RewardRunner:
        ref = f"./plugins.py:{name}"
        identity = resolve_plugin(
            ref, base_dir=plugin_file.parent, used_by="rewards[0].fn", builtins={}
        ).identity
        host = SidecarHost(
            server_argv(None, ref, identity.model_dump_json()), name=name, echo_stderr=False
        )
        made.append(SidecarCallable(host, timeout_s=TIMEOUT_S))
        return RewardRunner([describe(name, made[-1], 1.0, {}, TIMEOUT_S, **policy)])

    yield make
    for callable_ in made:
        callable_.close()
    pids = plugin_file.with_name("pids")
    children = {int(line) for line in pids.read_text().split()} if pids.exists() else set()
    for pid in children - {os.getpid()}:  # in_process() below scores in this process
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"sidecar {pid} outlived"


def in_process(plugin_file: Path, name: str, indices: list[int]) -> list[float]:
    """What the plugin scores these samples in the worker's own process."""
    spec = importlib.util.spec_from_file_location("in_process_plugins", plugin_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    runner = RewardRunner([describe(name, getattr(module, name), 1.0, {}, TIMEOUT_S)])
    scores = runner.score(
        [PROMPTS[i] for i in indices],
        [COMPLETIONS[i] for i in indices],
        [ROWS[i] for i in indices],
    )
    return scores.per_function[name]


@pytest.mark.parametrize(
    ("name", "cause"),
    [
        ("hangs_on_bad", f"no answer within {TIMEOUT_S:g} s (killed)"),
        ("segfaults_on_bad", "exited on signal SIGSEGV"),
        ("raises_on_bad", "raised ValueError: cannot parse 'BAD aaaa"),
    ],
)
def test_only_the_bad_sample_fails_and_the_rest_score_as_in_process(
    runner_for, plugin_file, name, cause
):
    runner = runner_for(name, on_error="fail_sample", failure_score=-1.0)
    started = time.monotonic()
    scores = runner.score(PROMPTS, COMPLETIONS, ROWS)
    elapsed = time.monotonic() - started
    assert list(scores.failed) == [name] and list(scores.failed[name]) == [BAD]
    assert cause in scores.failed[name][BAD]
    assert f"sample {BAD} of 8" in scores.failed[name][BAD]
    good = [i for i in range(8) if i != BAD]
    expected = dict(zip(good, in_process(plugin_file, name, good), strict=True))
    assert scores.per_function[name] == [expected.get(i, -1.0) for i in range(8)]
    assert scores.total == scores.per_function[name]
    # The whole batch twice, then one failing attempt per level (8 -> 4 -> 2 -> 1).
    assert elapsed < 2 * TIMEOUT_S + isolation_budget_s(TIMEOUT_S, 8) + 10


def test_the_stop_policy_names_the_sample_its_row_and_the_cause(runner_for):
    runner = runner_for("segfaults_on_bad")  # on_error = "stop", the default
    rows = [{**row, "id": f"row-{i}"} for i, row in enumerate(ROWS)]
    with pytest.raises(RewardError) as caught:
        runner.score(PROMPTS, COMPLETIONS, rows)
    message = str(caught.value)
    assert caught.value.reward == "segfaults_on_bad" and caught.value.sample == BAD
    assert message.startswith(f"reward 'segfaults_on_bad' failed on sample {BAD} of 8 ")
    assert "(row id 'row-5')" in message
    assert "exited on signal SIGSEGV" in message
    assert "its stderr ended with" in message and "scoring 'BAD aaaa" in message


def test_without_a_row_id_the_stop_error_quotes_the_prompts_start(runner_for):
    runner = runner_for("hangs_on_bad")
    with pytest.raises(RewardError) as caught:
        runner.score(PROMPTS, COMPLETIONS, ROWS)
    message = str(caught.value)
    assert f"sample {BAD} of 8 (prompt {PROMPTS[BAD]!r})" in message
    assert f"no answer within {TIMEOUT_S:g} s (killed)" in message


def test_a_function_that_fails_on_every_sample_stops_even_with_fail_sample(runner_for):
    """Every sample failing alone is the reward's fault, not the samples': no silent zeros."""
    runner = runner_for("raises_on_bad", on_error="fail_sample")
    with pytest.raises(RewardError) as caught:
        runner.score(PROMPTS[:3], ["BAD"] * 3, ROWS[:3])
    assert "failed on sample 0 of 3" in str(caught.value)
    assert "(and on each of the other 2 alone)" in str(caught.value)


# --- the bisection itself, on a plugin simulated in-process -----------------------------------


def failing_on(bad: set[int], calls: list[list[int]]):
    def attempt(indices):
        calls.append(list(indices))
        if bad & set(indices):
            raise RuntimeError(f"failed on {sorted(bad & set(indices))}")
        return [10 * i for i in indices]

    return attempt


def test_one_culprit_costs_one_failing_attempt_per_level():
    calls: list[list[int]] = []
    found = isolate(8, failing_on({5}, calls), first_cause="batch", budget_s=100)
    assert found.failed == {5: "failed on [5]"}
    assert found.values == {i: 10 * i for i in range(8) if i != 5}
    assert calls == [[0, 1, 2, 3], [4, 5, 6, 7], [4, 5], [4], [5], [6, 7]]


def test_several_culprits_are_all_found_and_stop_at_first_ends_at_the_first():
    found = isolate(8, failing_on({1, 6}, []), first_cause="batch", budget_s=100)
    assert sorted(found.failed) == [1, 6] and sorted(found.values) == [0, 2, 3, 4, 5, 7]
    calls: list[list[int]] = []
    first = isolate(8, failing_on({1, 6}, calls), first_cause="b", budget_s=100, stop_at_first=True)
    assert list(first.failed) == [1] and calls[-1] == [1]


def test_a_spent_budget_fails_what_is_left_with_the_reason():
    now = [0.0]

    def slow(indices):
        now[0] += 3.0  # each attempt "takes" 3 s
        return failing_on({5}, [])(indices)

    found = isolate(8, slow, first_cause="hang", budget_s=5.0, clock=lambda: now[0])
    assert found.values == {0: 0, 1: 10, 2: 20, 3: 30}
    assert set(found.failed) == {4, 5, 6, 7}
    assert "the 5 s allowed" in found.failed[4] and "(hang)" in found.failed[4]


def test_a_batch_of_one_is_its_own_culprit_without_another_call():
    calls: list[list[int]] = []
    found = isolate(1, failing_on({0}, calls), first_cause="hang", budget_s=10)
    assert found.failed == {0: "hang"} and calls == []


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
