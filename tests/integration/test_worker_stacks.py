"""A live worker sent SIGUSR1 writes every thread's stack to RUN_DIR/workers/rank-N.stacks and
goes on: how a run that seems hung shows where it waits (the test driver does it on a timeout)."""

from __future__ import annotations

import time

import pytest

from tests.integration.driver import only_run, rollout, start, worker_stacks

pytestmark = pytest.mark.slow  # a run of ~20 steps: 20-45 s


def test_sigusr1_dumps_a_live_workers_stacks_and_the_run_goes_on(workdir):
    process = start(
        workdir,
        *("run", "--config", "examples/grpo-tiny.toml", "--set", "data.eval=null"),
        *("--set", "rewards=[{ fn = './slow.py:slow' }]", "--set", "algorithm.max_steps=200"),
    )
    try:
        deadline = time.monotonic() + 120
        stacks = ""
        while "in slow" not in stacks:  # the reward's frame: the worker is inside it
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, f"no stack named the reward:\n{stacks}"
            stacks = worker_stacks(workdir)
        assert "rollout/runtime/worker.py" in stacks  # the whole stack, down to the entry point
        # The worker went on after the dump: the run records more steps, then stops when asked.
        store, record = only_run(workdir)
        steps_then = len(store.metrics(record.run_id, ["train/loss"]))
        while len(store.metrics(record.run_id, ["train/loss"])) <= steps_then:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no step after the dump"
            time.sleep(0.2)
        store_path = f"sqlite:{workdir / 'runs' / 'rollout.db'}"
        cancel = rollout(workdir, "runs", "cancel", record.run_id, "--store", store_path)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    finally:
        if process.poll() is None:
            process.communicate(timeout=120)
    assert store.get_run(record.run_id).status == "stopped"
    # The dumps stay in the run directory; a worker never sent the signal leaves no file.
    (dump,) = (workdir / "runs" / record.run_id / "workers").glob("rank-*.stacks")
    assert "in slow" in dump.read_text()
