"""`rollout snapshot save/restore` for real: a run on SQLite and local disk that fails at step 4,
snapshotted, restored into Postgres and S3 (moto, over the wire), and run to the end from there.

Each run starts Python and torch twice (host and worker): marked slow, as CI runs them.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from rollout.runtime import manifest
from rollout.storage import open_store
from tests.integration.driver import (
    COUNTING_REWARD,
    environment,
    only_run,
    processes_mentioning,
    rollout,
    start,
)

pytestmark = pytest.mark.slow


SETTINGS = (
    *("--set", "algorithm.max_steps=6"),
    *("--set", "checkpoint.interval=2"),
    *("--set", "checkpoint.keep_last=3"),
    *("--set", "data.eval=null"),
    *("--set", "rewards=[{ fn = './counting.py:counting' }]"),
)


def _run_failing_at_step_4(workdir: Path) -> str:
    (workdir / "examples" / "counting.py").write_text(COUNTING_REWARD)
    env = {**environment(workdir), "FAIL_AFTER": "3", "COUNT_FILE": str(workdir / "calls")}
    result = subprocess.run(
        [sys.executable, "-m", "rollout", "run", "--config", "examples/grpo-tiny.toml", *SETTINGS],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    _, record = only_run(workdir)
    assert record.status == "failed" and record.last_step == 3
    return record.run_id


def _last_line(output: str) -> str:
    return output.strip().splitlines()[-1]


def test_a_run_moves_from_sqlite_and_disk_to_postgres_and_s3_and_continues(
    workdir, postgres_location, s3_bucket
):
    run_id = _run_failing_at_step_4(workdir)
    old_store, _ = only_run(workdir)
    old_metrics = old_store.metrics(run_id)
    old_logs = old_store.logs(run_id, limit=100_000)
    (old_checkpoint_time,) = [c.time for c in old_store.checkpoints(run_id) if c.step == 2]

    saved = rollout(workdir, "snapshot", "save", run_id)
    assert saved.returncode == 0, saved.stdout + saved.stderr
    assert "Traceback" not in saved.stdout + saved.stderr
    snapshot = Path(_last_line(saved.stdout).rsplit(": ", 1)[1])
    assert snapshot.name == f"{run_id}-step-2" and snapshot.is_dir()
    assert manifest.problems(snapshot) == []
    described = json.loads((snapshot / "snapshot.json").read_text())
    assert described["step"] == 2 and described["status"] == "failed"
    # Records stop at the checkpoint's step: step 3's metrics are the continued run's to redo.
    metric_steps = {
        json.loads(line)["step"]
        for line in (snapshot / "records" / "metrics.jsonl").read_text().splitlines()
    }
    assert metric_steps == {1, 2}

    moved_to = f"{s3_bucket}/moved"
    artifacts = f"{moved_to}/moved-1"  # each run under a directory of its own
    restored = rollout(
        workdir,
        "snapshot",
        "restore",
        str(snapshot),
        "--as",
        "moved-1",
        "--store",
        postgres_location,
        "--artifacts",
        moved_to,
    )
    assert restored.returncode == 0, restored.stdout + restored.stderr
    plan_path = _last_line(restored.stdout).rsplit("rollout run --plan ", 1)[1]
    plan = json.loads(Path(plan_path).read_text())["plan"]
    assert plan["run_id"] == "moved-1"
    assert plan["derived"]["store"] == postgres_location
    assert plan["derived"]["artifacts"] == artifacts

    ran = rollout(workdir, "run", "--plan", plan_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr

    with open_store(postgres_location, create=False) as store:
        record = store.get_run("moved-1")
        assert record is not None and record.status == "finished" and record.last_step == 6
        metrics = store.metrics("moved-1")
        logs = store.logs("moved-1", limit=100_000)
        checkpoints = [c.step for c in store.checkpoints("moved-1")]
    # It continued from step 2, not from 0: the copied steps kept their first run's values and
    # times (a redone step would have rewritten them), steps 3..6 were trained by the new run.
    rewards = {m.step: m for m in metrics if m.name == "reward/mean"}
    assert sorted(rewards) == [1, 2, 3, 4, 5, 6]
    old_rewards = {m.step: m for m in old_metrics if m.name == "reward/mean"}
    for step in (1, 2):
        assert (rewards[step].value, rewards[step].time) == (
            old_rewards[step].value,
            old_rewards[step].time,
        )
    assert rewards[3].time > old_rewards[3].time
    messages = [line.message for line in logs]
    assert any(m.startswith("resumed from ") and m.endswith("at step 2") for m in messages)
    assert "training grpo for steps 3..6" in messages
    # The old run's log lines up to the checkpoint are there, each exactly once.
    copied = Counter((line.time, line.message) for line in logs)
    cut = [line for line in old_logs if line.time <= old_checkpoint_time]
    assert any(line.message == "training grpo for steps 1..6" for line in cut)
    assert [copied[(line.time, line.message)] for line in cut] == [1] * len(cut)
    assert not any(line.message.startswith("step 3/6") for line in logs[: len(cut)])
    assert checkpoints == [2, 4, 6]

    import fsspec

    fs = fsspec.filesystem("s3")
    held = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(artifacts.removeprefix("s3://")))
    assert "step-000006" in held
    # The old run is untouched.
    with open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False) as old:
        assert old.get_run(run_id).status == "failed"
        assert old.get_run("moved-1") is None


# --- a snapshot of a run that is still going

LIVE_SETTINGS = (
    *("--set", "algorithm.max_steps=200"),  # far more than the test lets it do
    *("--set", "checkpoint.interval=1"),
    *("--set", "checkpoint.keep_last=100"),  # no pruning: the checkpoint steps stay to compare
    *("--set", "generation.max_new_tokens=4"),
    *("--set", "data.eval=null"),
    *("--set", "rewards=[{ fn = './slow.py:slow' }]"),  # 0.3 s a step: it is still running
)


def _store(workdir: Path):
    return open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False)


def _wait_until(what: str, found, process: subprocess.Popen, timeout: float = 240):
    """found()'s first truthy answer, polled while `process` runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        with contextlib.suppress(FileNotFoundError):
            answer = found()
            if answer:
                return answer
        time.sleep(0.3)
    raise AssertionError(f"{what} within {timeout} s")


def _first_checkpoint(workdir: Path) -> str | None:
    if not (workdir / "runs" / "rollout.db").exists():
        return None
    with _store(workdir) as store:
        runs = store.list_runs()
        return runs[0].run_id if runs and store.checkpoints(runs[0].run_id) else None


def _resumed_at(workdir: Path, run_id: str) -> list[str]:
    with _store(workdir) as store:
        record = store.get_run(run_id)
        if record is None or record.status != "running":
            return []
        return [line.message for line in store.logs(run_id, limit=100_000)]


def _cancel(workdir: Path, run_id: str, process: subprocess.Popen) -> None:
    cancelled = rollout(workdir, "runs", "cancel", run_id)
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr


def _ended(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.communicate()


def test_a_running_run_is_snapshotted_at_a_committed_checkpoint_and_resumes_from_it(workdir):
    host = start(workdir, "run", "--config", "examples/grpo-tiny.toml", *LIVE_SETTINGS)
    try:
        run_id = _wait_until("no checkpoint", lambda: _first_checkpoint(workdir), host)
        saved = rollout(workdir, "snapshot", "save", run_id)
        assert host.poll() is None, "the run ended before the snapshot: it proves nothing"
        assert saved.returncode == 0, saved.stdout + saved.stderr
        assert "is still running" in saved.stdout
        _cancel(workdir, run_id, host)
    finally:
        _ended(host)

    snapshot = Path(_last_line(saved.stdout).rsplit(": ", 1)[1])
    described = json.loads((snapshot / "snapshot.json").read_text())
    step = described["step"]
    assert described["status"] == "running" and snapshot.name == f"{run_id}-step-{step}"
    with _store(workdir) as store:
        committed = {c.step: c.location for c in store.checkpoints(run_id)}
        last_step = store.get_run(run_id).last_step
    assert step in committed and last_step > step  # the run went on past the snapshot
    original = Path(committed[step])
    copied = snapshot / "checkpoint" / original.name
    assert (copied / "manifest.json").read_bytes() == (original / "manifest.json").read_bytes()
    assert manifest.problems(snapshot) == []
    verified = rollout(workdir, "checkpoints", "verify", str(copied))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    metric_steps = {
        json.loads(line)["step"]
        for line in (snapshot / "records" / "metrics.jsonl").read_text().splitlines()
    }
    assert max(metric_steps) == step  # the records stop where the checkpoint does

    restored = rollout(workdir, "snapshot", "restore", str(snapshot), "--as", "live-copy")
    assert restored.returncode == 0, restored.stdout + restored.stderr
    plan_path = _last_line(restored.stdout).rsplit("rollout run --plan ", 1)[1]
    resumed = start(workdir, "run", "--plan", plan_path)
    try:
        # The first is the old run's, copied with its records; the second, the restored run's.
        messages = _wait_until(
            "the restored run did not start training",
            lambda: [m for m in _resumed_at(workdir, "live-copy") if m.startswith("training ")][1:],
            resumed,
        )
        assert messages == [f"training grpo for steps {step + 1}..200"]
        logs = _resumed_at(workdir, "live-copy")
        assert any(m.startswith("resumed from ") and m.endswith(f"at step {step}") for m in logs)
        _cancel(workdir, "live-copy", resumed)
    finally:
        _ended(resumed)
    assert not processes_mentioning(str(workdir)), "a worker outlived its run"
