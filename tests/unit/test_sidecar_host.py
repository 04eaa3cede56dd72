"""Reward plugins in a sidecar (rollout.plugins.sidecar): a hung plugin is killed at its
deadline, a crash is survived by restarting and resubmitting the batch, and what the plugin
raises comes back as an error naming it. Real child processes throughout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rollout.harness.reward_contract import RewardError, describe
from rollout.harness.reward_runner import RewardRunner
from rollout.plugins.resolve import resolve_plugin
from rollout.plugins.sidecar.host import (
    SidecarCallable,
    SidecarError,
    SidecarHost,
    SidecarPluginError,
    server_argv,
)

PLUGINS = """
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

MARKER = Path(__file__).with_name("crashed")


def length(prompts, completions, scale=1.0):
    print("a plugin may print to stdout" * 1000)  # must not reach the protocol's channel
    return [scale * len(c) for c in completions]


def backtracks(prompts, completions):
    re.match(r"(a+)+$", "a" * 40 + "b")  # hours in C, holding the GIL
    return [0.0] * len(completions)


def segfaults(prompts, completions):
    os.kill(os.getpid(), signal.SIGSEGV)


def segfaults_once(prompts, completions):
    if not MARKER.exists():
        MARKER.touch()
        os.kill(os.getpid(), signal.SIGSEGV)
    return [float(len(c) % 5) for c in completions]


def exits_once(prompts, completions):
    if not MARKER.exists():
        MARKER.touch()
        os._exit(3)
    return [float(len(c) % 5) for c in completions]


def raises(prompts, completions):
    raise ValueError("no answer field in this row")


def not_json(prompts, completions):
    return [float("nan")] * len(completions)


def with_child(prompts, completions):
    child = subprocess.Popen(["sleep", "300"])
    Path(__file__).with_name("grandchild").write_text(str(child.pid))
    return [0.0] * len(completions)
"""

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["one", "three", "seventeen"]


@pytest.fixture
def plugin_file(tmp_path: Path) -> Path:
    path = tmp_path / "plugins.py"
    path.write_text(PLUGINS)
    return path


def host_for(plugin_file: Path, name: str, **options) -> SidecarHost:
    ref = f"./plugins.py:{name}"
    resolved = resolve_plugin(
        ref, base_dir=plugin_file.parent, used_by="rewards[0].fn", builtins={}
    )
    return SidecarHost(
        server_argv(None, ref, resolved.identity.model_dump_json()), name=name, **options
    )


@pytest.fixture
def sidecar(plugin_file):
    """A started SidecarCallable for a plugin of PLUGINS, closed after the test."""
    made = []

    def make(name: str, timeout_s: float = 10.0) -> SidecarCallable:
        made.append(SidecarCallable(host_for(plugin_file, name), timeout_s=timeout_s))
        return made[-1]

    yield make
    for callable_ in made:
        callable_.close()


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not one)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_sidecar_scores_like_the_function_and_keeps_prints_off_the_channel(sidecar):
    length = sidecar("length")
    assert length(PROMPTS, COMPLETIONS, scale=2.0) == [6.0, 10.0, 18.0]
    assert length(PROMPTS, COMPLETIONS) == [3.0, 5.0, 9.0]
    assert length.host.restarts == 0


def test_the_runner_reads_the_sidecars_signature_as_the_functions(sidecar):
    """Which dataset fields a reward is given comes from its signature: the child reports it."""
    length = sidecar("length")
    [function] = [describe("length", length, 1.0, {"scale": 0.5}, 10.0)]
    assert function.accepts == frozenset({"scale"})
    scores = RewardRunner([function]).score(PROMPTS, COMPLETIONS, [{"answer": "x"}] * 3)
    assert scores.per_function["length"] == [1.5, 2.5, 4.5]


def test_a_catastrophic_regex_is_killed_at_its_deadline_and_named(sidecar):
    # In the worker's own process this call would run for hours: the thread deadline cannot
    # interrupt a regex that holds the GIL. Here the host kills the child (twice: the batch is
    # resubmitted once) and reports the plugin.
    backtracks = sidecar("backtracks", timeout_s=1.0)
    first_pid = backtracks.host.pid
    with pytest.raises(SidecarError) as caught:
        backtracks(PROMPTS, COMPLETIONS)
    message = str(caught.value)
    assert "'backtracks'" in message and "a batch of 3" in message
    assert "no answer within 1 s (killed)" in message
    assert not alive(first_pid)


def test_through_the_runner_a_hung_sidecar_is_a_reward_error_naming_the_reward(sidecar):
    runner = RewardRunner([describe("regex", sidecar("backtracks", 0.5), 1.0, {}, 0.5)])
    with pytest.raises(RewardError) as caught:
        runner.score(PROMPTS, COMPLETIONS, [{}] * 3)
    assert caught.value.reward == "regex"
    # Every sample hangs: bisection names the first (tests/unit/test_sidecar_isolation.py).
    assert caught.value.sample == 0
    assert str(caught.value).startswith("reward 'regex' failed on sample 0 of 3 (prompt 'p0'): ")


def test_a_segfault_is_restarted_and_the_batch_resubmitted_until_it_fails_twice(sidecar):
    segfaults = sidecar("segfaults")
    with pytest.raises(SidecarError) as caught:
        segfaults(PROMPTS, COMPLETIONS)
    assert str(caught.value).count("exited on signal SIGSEGV") == 2
    assert "'segfaults'" in str(caught.value)


@pytest.mark.parametrize("name", ["segfaults_once", "exits_once"])
def test_a_plugin_that_crashes_once_succeeds_on_the_retry_with_the_same_results(
    sidecar, plugin_file, name
):
    crashes = sidecar(name)
    first_pid = crashes.host.pid
    scores = crashes(PROMPTS, COMPLETIONS)
    assert (plugin_file.parent / "crashed").exists()  # it did crash once
    assert crashes.host.restarts == 1 and crashes.host.pid != first_pid
    assert scores == [float(len(c) % 5) for c in COMPLETIONS]
    assert crashes(PROMPTS, COMPLETIONS) == scores  # and the restarted child stays up


def test_what_the_plugin_raises_is_an_error_naming_it_and_its_line_without_a_restart(sidecar):
    raises = sidecar("raises")
    with pytest.raises(SidecarPluginError) as caught:
        raises(PROMPTS, COMPLETIONS)
    message = str(caught.value)
    assert "'raises'" in message and "ValueError: no answer field in this row" in message
    assert "plugins.py:" in message
    assert raises.host.restarts == 0


def test_arguments_json_cannot_carry_are_an_error_naming_the_plugin(sidecar):
    length = sidecar("length")
    with pytest.raises(SidecarError) as caught:
        length(PROMPTS, COMPLETIONS, scale=object())
    assert "'length': a batch of 3 samples cannot be sent as JSON" in str(caught.value)
    assert length(PROMPTS, COMPLETIONS) == [3.0, 5.0, 9.0]  # nothing was sent; it is still up


def test_a_result_json_cannot_carry_is_an_error_not_a_silent_null(sidecar):
    with pytest.raises(SidecarPluginError, match="nan or inf"):
        sidecar("not_json")(PROMPTS, COMPLETIONS)


def test_close_ends_the_child_and_what_it_started(sidecar, plugin_file):
    with_child = sidecar("with_child")
    with_child(PROMPTS, COMPLETIONS)
    pid = with_child.host.pid
    grandchild = int((plugin_file.parent / "grandchild").read_text())
    assert alive(pid) and alive(grandchild)
    with_child.close()
    assert not alive(pid)
    _wait_until(lambda: not alive(grandchild))


def test_a_sidecar_started_from_a_thread_that_ends_lives_on(sidecar):
    """PR_SET_PDEATHSIG follows the thread that forked the child: children are forked from one
    long-lived thread, so a caller's short-lived thread ending does not kill its sidecar."""
    made = []
    thread = threading.Thread(target=lambda: made.append(sidecar("length")))
    thread.start()
    thread.join()
    [length] = made
    time.sleep(0.2)  # let a PDEATHSIG, if one were due, land before the call
    assert alive(length.host.pid)
    assert length(PROMPTS, COMPLETIONS) == [3.0, 5.0, 9.0]
    assert length.host.restarts == 0


HOST_SCRIPT = """
import sys
from pathlib import Path
from rollout.plugins.resolve import resolve_plugin
from rollout.plugins.sidecar.host import SidecarHost, server_argv

ref = "./plugins.py:length"
resolved = resolve_plugin(ref, base_dir=Path(sys.argv[1]), used_by="rewards[0].fn", builtins={})
host = SidecarHost(server_argv(None, ref, resolved.identity.model_dump_json()), name="length")
host.start()
print(host.pid, flush=True)
if sys.argv[2] == "hang":
    host.call([["p"], ["c"]], timeout_s=600)  # never answered: the child is stopped
"""


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_no_child_outlives_its_host(plugin_file, tmp_path, how):
    """A host that exits (atexit) or is SIGKILLed (the kernel's PR_SET_PDEATHSIG) takes its
    sidecar with it."""
    script = tmp_path / "host.py"
    script.write_text(HOST_SCRIPT)
    host = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), "hang" if how == "sigkill" else "exit"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert host.stdout is not None
    child = int(host.stdout.readline())
    if how == "sigkill":
        os.kill(child, signal.SIGSTOP)  # hung: it could not notice EOF on stdin
        assert alive(child)
        host.kill()
    host.wait()
    _wait_until(lambda: not alive(child))


def _wait_until(condition, limit_s: float = 20.0) -> None:
    """Poll (not a timing assertion: the limit only stops a broken test from hanging)."""
    end = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < end, "still alive"
        time.sleep(0.05)
