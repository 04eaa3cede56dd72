"""A run has one owner and no process outlives it: the host killed with each signal at random
moments (generating, writing a checkpoint), a second start of the same plan, a worker stuck or
dying in plugin code, a follower of a run whose owner died.

Each test drives the CLI in subprocesses on the tiny model, as a user would; the plugins here
start children of their own (which carry the workdir in their command line) so that "nothing
of the run is left" covers a plugin's processes too.
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import EXAMPLES
from tests.integration.driver import environment, processes_mentioning, rollout

pytestmark = pytest.mark.slow

# Starts a child (which would outlive a careless run) and keeps each step long enough to be hit.
FORKING_REWARD = """
import subprocess, sys, time
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
children = []

def forking(prompts, completions, **_):
    if not children:
        children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", HERE]))
    time.sleep(0.2)
    return [c.count("7") / max(1, len(c)) for c in completions]
"""

STUCK_REWARD = """
import re

calls = 0

def stuck(prompts, completions, **_):
    global calls
    calls += 1
    if calls == 2:  # catastrophic backtracking: C code that holds the GIL for hours
        re.match(r"(a+)+$", "a" * 64 + "b")
    return [0.0 for _ in completions]
"""

CRASHING_REWARD = """
import ctypes, os

calls = 0

def segv(prompts, completions, **_):
    global calls
    calls += 1
    if calls == 2:
        ctypes.string_at(0)
    return [0.0 for _ in completions]

def quits(prompts, completions, **_):
    os._exit(3)
"""

SETTINGS = [
    "--set",
    "algorithm.max_steps=6",
    "--set",
    "checkpoint.interval=2",
    "--set",
    "data.eval=null",
    "--set",
    "logging.level='debug'",  # each step logs the prompts it took
    "--set",
    "rewards=[{ fn = './forking.py:forking' }]",
    "--set",
    "algorithm.lr=1e-3",
]


def write_plugins(workdir: Path) -> Path:
    (workdir / "examples" / "forking.py").write_text(FORKING_REWARD)
    (workdir / "examples" / "stuck.py").write_text(STUCK_REWARD)
    (workdir / "examples" / "crashing.py").write_text(CRASHING_REWARD)
    return workdir


@pytest.fixture
def plugins(workdir: Path) -> Path:
    return write_plugins(workdir)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, Path]:
    """One working directory for the kill tests, and the plan of a run that was never killed,
    run to its end: what every interrupted and resumed run must end equal to."""
    workdir = tmp_path_factory.mktemp("kills")
    shutil.copytree(EXAMPLES, workdir / "examples")
    write_plugins(workdir)
    whole = plan(workdir, "whole", *SETTINGS)
    finished = rollout(workdir, "run", "--plan", str(whole))
    assert finished.returncode == 0, finished.stdout + finished.stderr
    nothing_left(workdir)  # a finished run leaves no plugin child behind either
    return workdir, whole


def plan(workdir: Path, name: str, *settings: str) -> Path:
    """`rollout plan` of grpo-tiny with `settings` (--set pairs), in this process: a CLI start
    per plan would cost seconds, and planning has its own tests."""
    from rollout.planner.builder import build_plan
    from rollout.planner.lockfile import write_plan

    overrides = [*settings[1::2], f"run.output_dir={workdir / 'runs'}"]
    path = workdir / f"{name}.lock"
    write_plan(build_plan(workdir / "examples" / "grpo-tiny.toml", overrides=overrides), path)
    return path


def start(workdir: Path, plan_path: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rollout", "run", "--plan", str(plan_path)],
        cwd=workdir,
        env={**environment(workdir), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_dir_of(plan_path: Path) -> Path:
    import json

    return Path(json.loads(plan_path.read_text())["plan"]["derived"]["run_dir"])


def status_of(workdir: Path, plan_path: Path) -> str:
    """The status as `rollout runs show` reports it: after reconciling dead owners."""
    from rollout.executor.ownership import reconcile
    from rollout.storage import open_store

    with open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False) as store:
        reconcile(store)
        return store.get_run(run_dir_of(plan_path).name).status


def final_weights(plan_path: Path) -> dict:
    checkpoint = run_dir_of(plan_path) / "checkpoints" / "step-000006"
    return load_file(checkpoint / "model" / "model.safetensors")


def wait_until(condition, *, timeout: float, every: float = 0.05, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(every)
    raise AssertionError(f"{what} did not happen within {timeout} s")


def nothing_left(workdir: Path, *, within: float = 5.0) -> None:
    wait_until(
        lambda: not processes_mentioning(str(workdir)),
        timeout=within,
        what="every process of the run ending",
    )


def a_step_done(plan_path: Path) -> bool:
    from rollout.storage import open_store

    database = run_dir_of(plan_path).parent / "rollout.db"
    if not database.exists():
        return False
    with open_store(f"sqlite:{database}", create=False) as store:
        run = store.get_run(run_dir_of(plan_path).name)
        return run is not None and (run.last_step or 0) >= 1


def stuck_in_reward(plan_path: Path) -> bool:
    import json

    activity = run_dir_of(plan_path) / "workers" / "rank-0.json"
    try:
        where = json.loads(activity.read_text())
    except (OSError, ValueError):
        return False
    return where["step"] == 2 and "reward 'stuck'" in (where["inside"] or "")


def a_checkpoint_being_written(plan_path: Path) -> bool:
    return any((run_dir_of(plan_path) / "checkpoints").glob(".step-*.tmp-*"))


@pytest.mark.parametrize(
    ("signum", "moment"),
    [
        (signal.SIGKILL, "checkpoint"),
        (signal.SIGTERM, "generation"),
        (signal.SIGINT, "checkpoint"),
        (signal.SIGHUP, "generation"),
    ],
    ids=lambda value: getattr(value, "name", value),
)
def test_a_host_killed_at_any_moment_leaves_nothing_and_resumes_exactly(
    uninterrupted, signum, moment
):
    workdir, whole = uninterrupted
    interrupted = plan(workdir, f"interrupted-{signum.name}-{moment}", *SETTINGS)
    host = start(workdir, interrupted)
    if moment == "checkpoint":
        wait_until(
            lambda: a_checkpoint_being_written(interrupted),
            timeout=120,
            every=0.002,
            what="a checkpoint write",
        )
    else:
        wait_until(lambda: a_step_done(interrupted), timeout=120, what="the first step")
        time.sleep(random.uniform(0.0, 0.4))  # somewhere in the next step's generation
    host.send_signal(signum)
    _, stderr = host.communicate(timeout=90)
    nothing_left(workdir)
    expected = "lost" if signum == signal.SIGKILL else "stopped"
    assert status_of(workdir, interrupted) == expected
    if signum != signal.SIGKILL:
        assert host.returncode == 130, stderr
        assert "Traceback" not in stderr
    if signum in (signal.SIGINT, signal.SIGTERM):  # after SIGHUP the terminal is gone: silence
        assert "resume with `rollout run --plan" in stderr

    resumed = rollout(workdir, "run", "--plan", str(interrupted))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming" in resumed.stdout
    nothing_left(workdir)
    assert status_of(workdir, interrupted) == "finished"
    reference, result = final_weights(whole), final_weights(interrupted)
    assert reference.keys() == result.keys()
    different = [name for name in reference if not (reference[name] == result[name]).all()]
    assert not different, f"resumed weights differ from an uninterrupted run's: {different}"
    # Every step's prompts, as last logged (a step redone after the kill logs twice): each of
    # the 6 steps took 2 prompts, none twice, none skipped.
    used = prompts_by_step(workdir, interrupted)
    assert sorted(used) == list(range(1, 7))
    every = [prompt for step in sorted(used) for prompt in used[step]]
    assert len(every) == len(set(every)) == 12


def prompts_by_step(workdir: Path, plan_path: Path) -> dict[int, list[str]]:
    from rollout.storage import open_store

    used: dict[int, list[str]] = {}
    with open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False) as store:
        lines = store.logs(run_dir_of(plan_path).name, level="debug", limit=100_000)
    for line in lines:
        if line.message.startswith("step ") and " prompts " in line.message:
            step, _, prompts = line.message.removeprefix("step ").partition(" prompts ")
            used[int(step)] = prompts.split(",")
    return used


def test_a_second_start_of_a_running_plan_is_refused_with_its_owner(plugins):
    workdir = plugins
    plan_path = plan(workdir, "once", *SETTINGS[:-4], "--set", "algorithm.max_steps=200")
    host = start(workdir, plan_path)
    try:
        wait_until(lambda: a_step_done(plan_path), timeout=120, what="the first step")
        second = rollout(workdir, "run", "--plan", str(plan_path))
        assert second.returncode == 2, second.stdout + second.stderr
        assert "is already running, owned by pid" in second.stderr
        assert f"pid {host.pid} " in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        host.send_signal(signal.SIGINT)
        host.communicate(timeout=90)
    nothing_left(workdir)
    assert status_of(workdir, plan_path) == "stopped"


def test_cancel_stops_a_worker_stuck_in_plugin_code(plugins):
    workdir = plugins
    plan_path = plan(
        workdir,
        "stuck",
        "--set",
        "algorithm.max_steps=50",
        "--set",
        "data.eval=null",
        "--set",
        "rewards=[{ fn = './stuck.py:stuck', timeout_s = 600 }]",
    )
    host = start(workdir, plan_path, ROLLOUT_STOP_GRACE_S="3")
    # The worker says where it is: inside the reward at step 2, spinning in C with the GIL held
    # (so not even its own store writer runs any more).
    wait_until(lambda: stuck_in_reward(plan_path), timeout=120, what="the reward getting stuck")
    cancelled = rollout(workdir, "runs", "cancel", run_dir_of(plan_path).name)
    assert cancelled.returncode == 0, cancelled.stderr
    host.communicate(timeout=60)
    assert host.returncode == 130
    nothing_left(workdir)
    assert status_of(workdir, plan_path) == "stopped"


@pytest.mark.parametrize(
    ("reward", "how", "step"),
    [("segv", "signal SIGSEGV", "step 2"), ("quits", "exit code 3", "step 1")],
)
def test_a_worker_dying_in_plugin_code_names_the_plugin_how_and_when(plugins, reward, how, step):
    workdir = plugins
    result = rollout(
        workdir,
        "run",
        "--config",
        "examples/grpo-tiny.toml",
        "--set",
        "algorithm.max_steps=4",
        "--set",
        "data.eval=null",
        "--set",
        f"rewards=[{{ fn = './crashing.py:{reward}' }}]",
    )
    assert result.returncode == 1
    error = result.stderr
    assert f"reward '{reward}'" in error and f"./crashing.py:{reward}" in error, error
    assert how in error and step in error, error
    if reward == "segv":  # faulthandler's stack names the plugin's own line
        assert "crashing.py" in error.split("Fatal Python error")[1]
    nothing_left(workdir)


def test_following_a_run_whose_owner_died_ends_and_the_run_is_lost(plugins):
    workdir = plugins
    plan_path = plan(workdir, "orphan", *SETTINGS[:-4], "--set", "algorithm.max_steps=200")
    host = start(workdir, plan_path)
    wait_until(lambda: a_step_done(plan_path), timeout=120, what="the first step")
    follower = subprocess.Popen(
        [sys.executable, "-m", "rollout", "logs", "tail", run_dir_of(plan_path).name, "--follow"],
        cwd=workdir,
        env=environment(workdir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)
    host.send_signal(signal.SIGKILL)
    host.communicate(timeout=30)
    _, stderr = follower.communicate(timeout=30)  # same machine: no need to wait for the lease
    assert follower.returncode == 0, stderr
    nothing_left(workdir)
    listed = rollout(workdir, "runs", "list")
    assert " lost " in listed.stdout, listed.stdout
