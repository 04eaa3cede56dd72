"""Object stores over the wire: s3fs against a moto server, gcsfs against a GCS emulator, both on
127.0.0.1 (tests/conftest.py). What the plan checks about a location it writes to (the bucket is
there, the credentials are accepted and may write, the endpoint answers), how each failure is
told, and data, prompts and generated output on s3:// and gs://.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.errors import PlanError, RolloutError
from rollout.planner import object_stores
from rollout.planner.builder import build_plan
from rollout.planner.definition import HardwareFacts
from rollout.planner.location_check import PROBE_PREFIX, writable_issue
from tests.conftest import TRAIN_RECORDS

runner = CliRunner()
GIB = 1024**3
LAPTOP = HardwareFacts(
    platform="test", cpu_count=8, memory_bytes=16 * GIB, memory_available_bytes=12 * GIB
)
KINDS = ["s3", "gs"]
ENDPOINT_VARIABLE = {"s3": "AWS_ENDPOINT_URL_S3", "gs": "STORAGE_EMULATOR_HOST"}


@pytest.fixture(params=KINDS)
def bucket(request: pytest.FixtureRequest) -> str:
    """A fresh bucket, once on S3 (moto) and once on GCS (the emulator)."""
    return request.getfixturevalue("s3_bucket" if request.param == "s3" else "gcs_bucket")


def kind_of(url: str) -> str:
    return url.split("://", 1)[0]


def put_jsonl(url: str, records: list[dict]) -> str:
    with fsspec.open(url, "wb") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in records).encode())
    return url


# --- the probe: a writable location passes and keeps nothing ---------------------------------------


def test_a_writable_prefix_passes_and_the_probe_object_is_removed(bucket):
    assert writable_issue(f"{bucket}/runs/ckpt", "storage.artifacts", "checkpoints") is None
    assert fsspec.filesystem(kind_of(bucket)).find(bucket) == []


def test_a_missing_bucket_is_named_with_how_to_create_it(bucket):
    missing = f"{kind_of(bucket)}://rollout-no-such-bucket-{time.monotonic_ns()}/ckpt"
    issue = writable_issue(missing, "storage.artifacts", "checkpoints")
    assert issue is not None and issue.path == "storage.artifacts"
    assert "does not exist" in issue.message and missing.split("/")[2] in issue.message
    assert "create it" in issue.hint


def test_a_closed_port_fails_fast_naming_the_endpoint(bucket, monkeypatch):
    kind = kind_of(bucket)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv(ENDPOINT_VARIABLE[kind], f"http://127.0.0.1:{port}")
    # gcsfs retries a refused connection with backoff; the deadline bounds it.
    monkeypatch.setattr(object_stores, "DEADLINE_SECONDS", 3.0)
    started = time.monotonic()
    issue = writable_issue(f"{bucket}/ckpt", "storage.artifacts", "checkpoints")
    assert time.monotonic() - started < 15  # botocore's defaults take 6+ s, gcsfs's 30+ s
    assert issue is not None and f"127.0.0.1:{port}" in issue.message
    assert "reach" in issue.message or "no answer" in issue.message
    assert ENDPOINT_VARIABLE[kind] in issue.hint


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An endpoint that accepts connections and never answers (a black-holed host)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def test_a_silent_endpoint_cannot_hang_the_plan(bucket, silent_endpoint, monkeypatch):
    monkeypatch.setenv(ENDPOINT_VARIABLE[kind_of(bucket)], silent_endpoint)
    monkeypatch.setattr(object_stores, "DEADLINE_SECONDS", 2.0)
    started = time.monotonic()
    issue = writable_issue(f"{bucket}/ckpt", "storage.artifacts", "checkpoints")
    assert time.monotonic() - started < 10
    assert issue is not None and "no answer" in issue.message and "within 2 s" in issue.message


# --- credentials: moto checks them once IAM authentication is switched on ------------------------


@pytest.fixture
def s3_auth(s3_server, s3_bucket) -> Iterator[tuple[str, dict[str, str]]]:
    """The bucket, and a read-only IAM user's keys; moto enforces authentication meanwhile."""
    import boto3
    import requests

    iam = boto3.client("iam", endpoint_url=s3_server.endpoint, region_name="us-east-1")
    user = f"reader-{time.monotonic_ns()}"
    iam.create_user(UserName=user)
    bucket = s3_bucket.removeprefix("s3://")
    policy = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Action": ["s3:GetObject", "s3:ListBucket"],
                "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
            }
        ],
    }
    iam.put_user_policy(UserName=user, PolicyName="read", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    reader = {
        "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
    }
    requests.post(f"{s3_server.endpoint}/moto-api/reset-auth", data=b"0", timeout=10)
    try:
        yield s3_bucket, reader
    finally:
        requests.post(f"{s3_server.endpoint}/moto-api/reset-auth", data=b"inf", timeout=10)


def test_credentials_the_store_does_not_know_are_refused(s3_auth, monkeypatch):
    bucket, _ = s3_auth
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-at-all")
    issue = writable_issue(f"{bucket}/ckpt", "storage.artifacts", "checkpoints")
    assert issue is not None and "refused the credentials" in issue.message
    assert "InvalidAccessKeyId" in issue.message and "AWS_ACCESS_KEY_ID" in issue.hint
    assert "not-the-secret-at-all" not in str(issue)


def test_credentials_that_may_only_read_are_told_to_get_write_access(s3_auth, monkeypatch):
    bucket, reader = s3_auth
    for name, value in reader.items():
        monkeypatch.setenv(name, value)
    issue = writable_issue(f"{bucket}/ckpt", "storage.artifacts", "checkpoints")
    assert issue is not None and "may not write checkpoints" in issue.message
    assert "s3:PutObject" in issue.hint
    assert reader["AWS_SECRET_ACCESS_KEY"] not in str(issue)


def test_no_credentials_at_all_says_where_they_come_from(s3_bucket, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    issue = writable_issue(f"{s3_bucket}/ckpt", "storage.artifacts", "checkpoints")
    # s3fs falls back to anonymous access when no credentials are found; moto lets that write,
    # so either the probe passes or it names the missing credentials.
    assert issue is None or "credentials" in issue.message


# --- through `rollout plan` and `rollout validate` -------------------------------------------------


def test_plan_refuses_a_missing_bucket_in_one_error_with_exit_2(
    bucket, config_file, base_config, tmp_path
):
    missing = f"{kind_of(bucket)}://rollout-no-such-bucket-{time.monotonic_ns()}/ckpt"
    base_config["storage"] = {"artifacts": missing}
    path = config_file(base_config)
    result = runner.invoke(app, ["plan", "--config", str(path), "-o", str(tmp_path / "p.lock")])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "storage.artifacts" in result.output and "does not exist" in result.output
    assert not (tmp_path / "p.lock").exists()
    # validate checks the form only: it neither needs nor touches the network.
    assert runner.invoke(app, ["validate", "--config", str(path)]).exit_code == 0


def test_plan_accepts_artifacts_in_a_bucket_and_leaves_no_probe(
    bucket, config_file, base_config, tmp_path
):
    base_config["storage"] = {"artifacts": f"{bucket}/ckpt"}
    plan = build_plan(config_file(base_config), hardware=LAPTOP)
    assert plan.derived.artifacts == f"{bucket}/ckpt/{plan.run_id}"
    leftovers = fsspec.filesystem(kind_of(bucket)).find(bucket)
    assert not [name for name in leftovers if PROBE_PREFIX in name]


@pytest.mark.parametrize(
    ("key", "url"),
    [
        ("storage.artifacts", "s3://AKIAXX:hunter2secret@bucket/ckpt"),
        ("storage.artifacts", "gs://user:hunter2secret@bucket/ckpt"),
        ("data.train.path", "s3://AKIAXX:hunter2secret@bucket/train.jsonl"),
        ("data.train.path", "gs://user:hunter2secret@bucket/train.jsonl"),
    ],
)
def test_a_url_carrying_a_password_is_refused_at_validate(key, url, config_file, base_config):
    if key == "storage.artifacts":
        base_config["storage"] = {"artifacts": url}
    else:
        base_config["data"]["train"]["path"] = url
    result = runner.invoke(app, ["validate", "--config", str(config_file(base_config))])
    assert result.exit_code == 2 and key in result.output
    assert "carries a password" in result.output and "hunter2secret" not in result.output


def test_mlflow_on_an_object_store_is_refused(config_file, base_config):
    base_config["logging"] = {"trackers": ["mlflow"], "mlflow_tracking_uri": "s3://bucket/mlruns"}
    with pytest.raises((PlanError, RolloutError)) as caught:
        build_plan(config_file(base_config), hardware=LAPTOP)
    assert "logging.mlflow_tracking_uri" in [issue.path for issue in caught.value.issues]


# --- data read from the store ----------------------------------------------------------------------


def test_plan_reads_train_and_eval_data_from_the_bucket(bucket, config_file, base_config):
    import pyarrow as pa
    import pyarrow.parquet as pq

    train = put_jsonl(f"{bucket}/data/train.jsonl", TRAIN_RECORDS)
    evaluation = f"{bucket}/data/eval.parquet"
    with fsspec.open(evaluation, "wb") as handle:
        pq.write_table(pa.Table.from_pylist(TRAIN_RECORDS[:6]), handle)
    base_config["data"]["train"] = {"path": train}
    base_config["data"]["eval"] = {"path": evaluation}
    plan = build_plan(config_file(base_config), hardware=LAPTOP)
    facts = {f.split: f for f in plan.data}
    assert facts["train"].num_records == len(TRAIN_RECORDS) and facts["train"].location == train
    assert facts["eval"].num_records == 6 and facts["eval"].location == evaluation


def test_a_missing_data_object_is_the_usual_not_found_error_with_its_url(
    bucket, config_file, base_config
):
    base_config["data"]["train"] = {"path": f"{bucket}/data/nope.jsonl"}
    with pytest.raises(PlanError) as caught:
        build_plan(config_file(base_config), hardware=LAPTOP)
    (issue,) = caught.value.issues
    assert issue.path == "data.train.path"
    assert f"train data file not found: {bucket}/data/nope.jsonl" in issue.message


def test_data_on_an_unreachable_store_is_one_plan_error(
    bucket, config_file, base_config, monkeypatch
):
    put_jsonl(f"{bucket}/train.jsonl", TRAIN_RECORDS)
    base_config["data"]["train"] = {"path": f"{bucket}/train.jsonl"}
    path = config_file(base_config)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv(ENDPOINT_VARIABLE[kind_of(bucket)], f"http://127.0.0.1:{port}")
    monkeypatch.setattr(object_stores, "DEADLINE_SECONDS", 3.0)
    with pytest.raises(PlanError) as caught:
        build_plan(path, hardware=LAPTOP)
    (issue,) = caught.value.issues
    assert issue.path == "data.train.path" and f"127.0.0.1:{port}" in issue.message


# --- rollout generate: prompts from, output to the store ------------------------------------------


def _generate(prompts: str, out: str, *extra: str):
    return runner.invoke(
        app,
        [
            "generate",
            "--model",
            "tiny-llama",
            "--prompts",
            prompts,
            "--out",
            out,
            "--max-new-tokens",
            "4",
            "--temperature",
            "0",
            *extra,
        ],
    )


def test_generate_reads_prompts_from_and_writes_output_to_a_bucket(
    bucket, rollout_cache, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    prompts = put_jsonl(f"{bucket}/in/prompts.jsonl", TRAIN_RECORDS[:3])
    out = f"{bucket}/out/completions.jsonl"
    result = _generate(prompts, out)
    assert result.exit_code == 0, result.output
    with fsspec.open(out, "rb") as handle:
        rows = [json.loads(line) for line in handle.read().splitlines()]
    assert [row["prompt"] for row in rows] == [r["prompt"] for r in TRAIN_RECORDS[:3]]
    assert all(isinstance(row["completion"], str) for row in rows)
    # Again: already complete, nothing generated; a different job may not replace it silently.
    again = _generate(prompts, out)
    assert again.exit_code == 0 and "already complete" in again.output
    other = _generate(prompts, f"{bucket}/out/completions.jsonl", "--n", "2")
    assert other.exit_code == 2 and "--out" in other.output


def test_generate_refuses_an_existing_object_it_did_not_write(bucket, rollout_cache, tmp_path):
    prompts = put_jsonl(f"{bucket}/prompts.jsonl", TRAIN_RECORDS[:2])
    taken = put_jsonl(f"{bucket}/taken.jsonl", [{"x": 1}])
    result = _generate(prompts, taken)
    assert result.exit_code == 2 and "already exists" in result.output
    assert "--overwrite" in result.output


def test_generate_to_a_missing_bucket_fails_before_loading_a_model(bucket, rollout_cache):
    prompts = put_jsonl(f"{bucket}/prompts.jsonl", TRAIN_RECORDS[:2])
    missing = f"{kind_of(bucket)}://rollout-no-such-bucket-{time.monotonic_ns()}/o.jsonl"
    result = _generate(prompts, missing)
    assert result.exit_code == 2, result.output
    assert "does not exist" in result.output and "loading" not in result.output
    assert "Traceback" not in result.output


def test_a_failed_upload_leaves_no_object_and_the_next_run_uploads_without_generating(
    s3_bucket, rollout_cache, tmp_path, monkeypatch
):
    from rollout.inference import remote_output

    prompts = put_jsonl(f"{s3_bucket}/prompts.jsonl", TRAIN_RECORDS[:2])
    out = f"{s3_bucket}/out.jsonl"
    real_upload = remote_output.upload

    def broken(staging: Path, url: str) -> None:
        raise RolloutError(
            remote_output.failure_issue(
                ConnectionRefusedError(), url, "--out", doing="upload the output to", writing=True
            )
        )

    monkeypatch.setattr(remote_output, "upload", broken)
    failed = _generate(prompts, out)
    assert failed.exit_code == 2 and not fsspec.filesystem("s3").exists(out)
    monkeypatch.setattr(remote_output, "upload", real_upload)
    retried = _generate(prompts, out)
    assert retried.exit_code == 0 and "already complete" in retried.output
    assert fsspec.filesystem("s3").exists(out)
