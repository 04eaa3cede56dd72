"""A GRPO run whose checkpoints go to S3 (a moto server over loopback): committed by manifest on
an upload thread, listed, verified and exported by `rollout checkpoints`, and resumed past a
damaged newest checkpoint when the failed run's plan runs again."""

from __future__ import annotations

import json
import subprocess
import sys

import fsspec
import pytest
import torch
from safetensors.torch import load_file

from rollout.planner.lockfile import read_plan
from rollout.storage import open_store
from tests.integration.driver import COUNTING_REWARD, environment, rollout

pytestmark = pytest.mark.slow


def _run(workdir, *, fail_after: int | None = None):
    env = environment(workdir)
    if fail_after is not None:
        env |= {"FAIL_AFTER": str(fail_after), "COUNT_FILE": str(workdir / "calls")}
    return subprocess.run(
        [sys.executable, "-m", "rollout", "run", "--plan", "plan.lock"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_s3_checkpoints_resume_past_a_damaged_one_and_export(workdir, s3_bucket):
    (workdir / "examples" / "counting.py").write_text(COUNTING_REWARD)
    planned = rollout(
        workdir,
        "plan",
        "--config",
        "examples/grpo-tiny.toml",
        *("--set", "algorithm.max_steps=4", "--set", "data.eval=null"),
        *("--set", "checkpoint.interval=1", "--set", "checkpoint.keep_last=3"),
        *("--set", f"storage.artifacts='{s3_bucket}/grpo'"),
        *("--set", "rewards=[{ fn = './counting.py:counting' }]"),
        *("-o", "plan.lock"),
    )
    assert planned.returncode == 0, planned.stdout + planned.stderr
    artifacts = read_plan(workdir / "plan.lock").derived.artifacts
    first = _run(workdir, fail_after=3)  # fails at step 4, after committing steps 1 to 3
    assert first.returncode == 1, first.stdout + first.stderr
    store = open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False)
    (record,) = store.list_runs()
    assert record.status == "failed" and record.last_step == 3
    assert [c.step for c in store.checkpoints(record.run_id)] == [1, 2, 3]
    assert store.checkpoints(record.run_id)[-1].location == f"{artifacts}/step-000003"
    for name in ("perf/checkpoint_blocking_s", "perf/checkpoint_commit_s"):
        assert {m.step for m in store.metrics(record.run_id, [name])} == {1, 2, 3}, name

    listed = rollout(workdir, "checkpoints", "list", record.run_id, "--format", "json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["checkpoints"]
    assert [(r["step"], r["state"]) for r in rows] == [(i, "committed") for i in (1, 2, 3)]
    assert all(r["recorded_at"] and r["bytes"] > 0 for r in rows)

    # Corrupt the newest: one byte of its weights, same size.
    fs = fsspec.filesystem("s3")
    weights = f"{artifacts.removeprefix('s3://')}/step-000003/model/model.safetensors"
    data = bytearray(fs.cat_file(weights))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(weights, bytes(data))
    verified = rollout(workdir, "checkpoints", "verify", artifacts)
    assert verified.returncode == 2, verified.stdout + verified.stderr
    assert "Traceback" not in verified.stdout + verified.stderr
    assert "damaged" in verified.stdout and "step-000003" in verified.stdout
    assert "model/model.safetensors does not match its sha256" in verified.stdout
    good = rollout(workdir, "checkpoints", "verify", f"{artifacts}/step-000002")
    assert good.returncode == 0 and "good" in good.stdout

    # Running the plan again resumes from the newest good checkpoint, step 2.
    second = _run(workdir)
    assert second.returncode == 0, second.stdout + second.stderr
    (resumed,) = store.list_runs()
    assert resumed.status == "finished" and resumed.last_step == 4
    logs = rollout(workdir, "logs", "tail", resumed.run_id, "-n", "400")
    assert "skipping checkpoint" in logs.stdout and "step-000003" in logs.stdout
    assert "does not match its sha256" in logs.stdout
    assert "resumed from" in logs.stdout and "step-000002 at step 2" in logs.stdout

    # Export the newest: a plain Hugging Face directory, the checkpoint's weights.
    out = workdir / "exported"
    exported = rollout(workdir, "checkpoints", "export", resumed.run_id, "--to", str(out))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert "exported step 4" in exported.stdout
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    saved = load_file(out / "model.safetensors")
    assert set(saved) and all(
        torch.equal(model.state_dict()[name], tensor) for name, tensor in saved.items()
    )
    remote = fsspec.filesystem("s3").cat_file(
        f"{artifacts.removeprefix('s3://')}/step-000004/model/model.safetensors"
    )
    assert (out / "model.safetensors").read_bytes() == remote

    # (The resumed run saved step 3 again.) A damaged step is never exported.
    weights = weights.replace("step-000003", "step-000002")
    data = bytearray(fs.cat_file(weights))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(weights, bytes(data))
    refused = rollout(
        workdir, "checkpoints", "export", f"{resumed.run_id}:2", "--to", str(workdir / "x")
    )
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "does not match its sha256" in refused.stderr
    assert not (workdir / "x").exists()
    taken = rollout(workdir, "checkpoints", "export", resumed.run_id, "--to", str(out))
    assert taken.returncode == 2 and "not empty" in taken.stderr
