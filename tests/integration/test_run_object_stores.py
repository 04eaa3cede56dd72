"""A real run with everything it reads and writes on an object store: training data read from a
bucket, checkpoints written to it, and a resume that reads them back. Once on S3 (s3fs against
a moto server) and once on GCS (gcsfs against the emulator), over 127.0.0.1.

The credentials come from the environment, as the providers' chains find them; the test makes
them unique and then looks for them in everything the run left: plan.lock, the run directory,
the run store's rows and the bucket.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import fsspec
import pytest

from rollout.planner.lockfile import read_plan
from tests.integration.driver import only_run, rollout

pytestmark = pytest.mark.slow


@pytest.fixture(params=["s3", "gs"])
def bucket(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("s3_bucket" if request.param == "s3" else "gcs_bucket")


@pytest.fixture
def unique_credentials(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """AWS credentials no file or row could hold by chance (moto accepts any)."""
    values = {
        "AWS_ACCESS_KEY_ID": f"AKIA{secrets.token_hex(8).upper()}",
        "AWS_SECRET_ACCESS_KEY": f"secret{secrets.token_hex(16)}",
        "AWS_SESSION_TOKEN": f"session{secrets.token_hex(16)}",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return list(values.values())


def test_a_run_reads_data_from_and_checkpoints_to_a_bucket_then_resumes(
    workdir: Path, bucket: str, unique_credentials: list[str]
):
    scheme = bucket.split("://", 1)[0]
    fs = fsspec.filesystem(scheme)
    train = f"{bucket}/data/arith-train.jsonl"
    fs.put_file(str(workdir / "examples" / "data" / "arith-train.jsonl"), train)
    settings = [
        f'data.train.path="{train}"',
        "data.eval=null",
        f'storage.artifacts="{bucket}/checkpoints"',
        "algorithm.max_steps=2",
        "checkpoint.interval=1",
        "generation.max_new_tokens=4",
    ]
    overrides = [part for setting in settings for part in ("--set", setting)]
    planned = rollout(
        workdir, "plan", "--config", "examples/grpo-tiny.toml", *overrides, "-o", "plan.lock"
    )
    assert planned.returncode == 0, planned.stdout + planned.stderr
    artifacts = read_plan(workdir / "plan.lock").derived.artifacts
    assert artifacts.startswith(f"{bucket}/checkpoints/")  # a directory of the run's own
    first = rollout(workdir, "run", "--plan", "plan.lock")
    assert first.returncode == 0, first.stdout + first.stderr
    store, record = only_run(workdir)
    assert record.status == "finished" and record.last_step == 2
    locations = [c.location for c in store.checkpoints(record.run_id)]
    assert locations == [f"{artifacts}/step-000001", f"{artifacts}/step-000002"]
    assert fs.exists(f"{artifacts}/step-000002/model/model.safetensors")
    assert not [p for p in fs.find(bucket) if ".rollout-probe-" in p]  # the plan's probe

    # As if it had stopped after step 1: its last checkpoint gone, the same plan resumes from
    # step 1's, downloaded from the bucket, and trains step 2 again.
    fs.rm(f"{artifacts}/step-000002", recursive=True)
    store.set_status(record.run_id, "stopped")
    store.close()
    second = rollout(workdir, "run", "--plan", "plan.lock")
    assert second.returncode == 0, second.stdout + second.stderr
    store, record = only_run(workdir)
    assert record.status == "finished" and record.last_step == 2
    logs = rollout(workdir, "logs", "tail", record.run_id)
    assert f"resumed from {artifacts}/step-000001 at step 1" in logs.stdout, logs.stdout
    assert fs.exists(f"{artifacts}/step-000002/model/model.safetensors")

    # The credentials reached the run only through the environment, and nothing wrote them down.
    leaked = {
        str(path.relative_to(workdir)): value
        for path in workdir.rglob("*")
        if path.is_file() and "cache" not in path.relative_to(workdir).parts
        for value in unique_credentials
        if value.encode() in path.read_bytes()
    }
    texts = [logs.stdout, planned.stdout + planned.stderr, first.stdout + first.stderr]
    for name in fs.find(bucket):
        if not name.endswith(".safetensors"):
            texts.append(fs.cat_file(name).decode("utf-8", "replace"))
    leaked.update(
        {
            f"output {i}": value
            for i, text in enumerate(texts)
            for value in unique_credentials
            if value in text
        }
    )
    assert not leaked, f"credentials written to: {sorted(leaked)}"
    assert (workdir / "plan.lock").is_file() and (workdir / "runs" / "rollout.db").is_file()
