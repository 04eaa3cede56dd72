"""`rollout snapshot save/restore` on a run made in place (a real plan and store, a checkpoint
directory committed as the saver commits one), through the CLI: what goes into a snapshot, what
a restore creates, and each bad input refused with exit 2 and nothing left behind. The whole
journey with real runs, Postgres and S3 is tests/integration/test_snapshot.py."""

from __future__ import annotations

import json
import math
import os
import signal
import socketserver
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.errors import PlanError
from rollout.planner.builder import build_plan
from rollout.planner.criu_check import _complaint, criu_problem
from rollout.planner.lockfile import read_plan, write_plan
from rollout.runtime import manifest
from rollout.storage import open_store
from rollout.storage.base import CheckpointRecord, MetricRecord, RunRecord, SampleRecord

runner = CliRunner()
RUN = "t-run"


@pytest.fixture
def made_run(tmp_path, config_file, base_config, rollout_cache):
    """Run RUN in tmp_path/runs: a plan, store rows of steps 1..3, checkpoint step 2 on disk."""
    base_config["run"]["output_dir"] = str(tmp_path / "runs")
    plan = build_plan(config_file(base_config), run_id=RUN)
    run_dir = Path(plan.derived.run_dir)
    write_plan(plan, run_dir / "plan.lock")
    sha = json.loads((run_dir / "plan.lock").read_text())["sha256"]
    checkpoint = Path(plan.derived.artifacts) / "step-000002"
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "model" / "model.safetensors").write_bytes(os.urandom(4096))
    (checkpoint / "trainer.json").write_text(json.dumps({"step": 2}))
    committed = manifest.build_manifest(checkpoint, step=2, run_id=RUN, plan="p")
    (checkpoint / manifest.MANIFEST).write_bytes(manifest.manifest_bytes(committed))
    with open_store(plan.derived.store) as store:
        store.create_run(
            RUN,
            name="t",
            plan_sha256=sha,
            plan_path=str(run_dir / "plan.lock"),
            run_dir=str(run_dir),
        )
        store.add_metrics(MetricRecord(RUN, s, "reward/mean", s / 10, time.time()) for s in (1, 2))
        store.add_logs([(RUN, time.time(), "info", 0, "actor+learner", "step 2 done")])
        store.add_checkpoint(CheckpointRecord(RUN, 2, str(checkpoint), time.time()))
        time.sleep(0.01)
        store.add_metrics([MetricRecord(RUN, 3, "reward/mean", 0.3, time.time())])
        store.add_samples(
            SampleRecord(RUN, s, 0, "p", "c", None, math.nan, {"f": math.inf}, time.time())
            for s in (1, 2, 3)
        )
        store.add_samples([SampleRecord(RUN, 2, 1, "p", "answer", AGENT_TURNS, 1.0, {}, 0.0)])
        store.add_logs([(RUN, time.time(), "info", 0, "actor+learner", "step 3 done")])
    return plan


AGENT_TURNS = [
    {"role": "user", "content": "p"},
    {"role": "assistant", "content": "4", "call": 1, "policy_version": 2, "tokens": 3},
]
"""An agent episode's calls: turns whose metadata are numbers."""


def invoke(*args: str):
    result = runner.invoke(app, list(args))
    assert "Traceback" not in result.output
    return result


def save(plan, *extra: str) -> Path:
    result = invoke("snapshot", "save", RUN, "--store", plan.derived.store, *extra)
    assert result.exit_code == 0, result.output
    return Path(result.output.strip().splitlines()[-1].rsplit(": ", 1)[1])


def test_a_snapshot_holds_the_plan_checkpoint_and_records_up_to_its_step(made_run):
    snapshot = save(made_run)
    assert snapshot == Path(made_run.derived.artifacts) / "snapshots" / f"{RUN}-step-2"
    assert manifest.problems(snapshot) == []
    assert (snapshot / "plan.lock").read_bytes() == (
        Path(made_run.derived.run_dir) / "plan.lock"
    ).read_bytes()
    assert (snapshot / "checkpoint/step-000002/model/model.safetensors").read_bytes() == (
        Path(made_run.derived.artifacts) / "step-000002/model/model.safetensors"
    ).read_bytes()
    records = snapshot / "records"
    steps = [json.loads(line)["step"] for line in (records / "metrics.jsonl").open()]
    assert steps == [1, 2]  # step 3 is after the checkpoint
    logs = [json.loads(line)["message"] for line in (records / "logs.jsonl").open()]
    assert logs == ["step 2 done"]
    samples = [json.loads(line) for line in (records / "samples.jsonl").open()]
    assert [(row["step"], row["reward"], row["extra"]) for row in samples] == [
        (1, None, {"f": None}),
        (2, None, {"f": None}),
        (2, 1.0, {}),
    ]
    assert samples[2]["turns"] == AGENT_TURNS
    assert json.loads((records / "run.json").read_text())["run_id"] == RUN


def test_a_restored_run_is_in_the_new_store_with_its_checkpoint_and_a_plan_run_accepts(
    made_run, tmp_path
):
    snapshot = save(made_run)
    location = f"sqlite:{tmp_path / 'other' / 'rollout.db'}"
    result = invoke(
        "snapshot", "restore", str(snapshot), "--as", "t-new", "--store", location,
        "--artifacts", str(tmp_path / "elsewhere"),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    plan_path = Path(result.output.strip().rsplit("rollout run --plan ", 1)[1])
    plan = read_plan(plan_path)  # fresh and unedited: what `rollout run` checks
    assert plan.run_id == "t-new" and plan.derived.store == location
    assert plan.derived.artifacts == str(tmp_path / "elsewhere" / "t-new")
    assert plan.config.storage.sqlite_path == str(tmp_path / "other" / "rollout.db")
    assert (tmp_path / "elsewhere" / "t-new" / "step-000002" / manifest.MANIFEST).is_file()
    with open_store(location, create=False) as store:
        run = store.get_run("t-new")
        assert run.plan_sha256 == json.loads(plan_path.read_text())["sha256"]
        assert run.status == "planned" and run.last_step == 2
        assert [m.step for m in store.metrics("t-new")] == [1, 2]
        assert [line.message for line in store.logs("t-new")] == ["step 2 done"]
        samples = store.samples("t-new")
        assert [x.step for x in samples] == [1, 2, 2] and math.isnan(samples[0].reward)
        assert samples[2].turns == AGENT_TURNS and samples[2].completion == "answer"
        (checkpoint,) = store.checkpoints("t-new")
        assert checkpoint.location == str(tmp_path / "elsewhere" / "t-new" / "step-000002")


def _refused(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    for word in words:
        assert word in result.output, result.output


def _nothing_made(tmp_path: Path, location: str | None = None) -> None:
    assert not (tmp_path / "runs" / "t-new").exists()
    assert not (tmp_path / "elsewhere").exists()
    if location is not None and Path(location.removeprefix("sqlite:")).exists():
        with open_store(location, create=False) as store:
            assert store.get_run("t-new") is None


def test_an_unknown_run_is_refused(made_run):
    result = invoke("snapshot", "save", "t-rnu", "--store", made_run.derived.store)
    _refused(result, "no run 't-rnu'", "did you mean 't-run'")


def test_a_run_without_a_checkpoint_is_refused(made_run):
    (Path(made_run.derived.artifacts) / "step-000002" / manifest.MANIFEST).unlink()
    _refused(invoke("snapshot", "save", RUN, "--store", made_run.derived.store), "no committed")


def test_a_snapshot_is_never_written_over(made_run):
    snapshot = save(made_run)
    result = invoke(
        "snapshot", "save", RUN, "--store", made_run.derived.store, "--to", str(snapshot)
    )
    _refused(result, "already there")


@pytest.mark.parametrize("damage", ["change", "delete", "manifest"])
def test_a_damaged_snapshot_is_not_restored(made_run, tmp_path, damage):
    snapshot = save(made_run)
    weights = snapshot / "checkpoint/step-000002/model/model.safetensors"
    if damage == "change":
        weights.write_bytes(b"x" + weights.read_bytes()[1:])
    elif damage == "delete":
        weights.unlink()
    else:
        (snapshot / "manifest.json").unlink()
    location = f"sqlite:{tmp_path / 'other.db'}"
    result = invoke(
        "snapshot", "restore", str(snapshot), "--as", "t-new", "--store", location,
        "--artifacts", str(tmp_path / "elsewhere"),
    )  # fmt: skip
    _refused(result, "does not match its manifest")
    _nothing_made(tmp_path, location)
    assert not Path(location.removeprefix("sqlite:")).exists()


def test_a_run_id_that_exists_is_refused(made_run, tmp_path):
    snapshot = save(made_run)
    result = invoke(
        "snapshot",
        "restore",
        str(snapshot),
        "--as",
        RUN,
        "--artifacts",
        str(tmp_path / "elsewhere"),
    )
    _refused(result, "already exists")
    assert not (tmp_path / "elsewhere").exists()


def test_an_unreachable_store_is_refused_before_anything_is_made(made_run, tmp_path, monkeypatch):
    snapshot = save(made_run)
    monkeypatch.setenv("SNAPSHOT_TEST_DSN", "host=127.0.0.1 port=9 dbname=x connect_timeout=2")
    result = invoke(
        "snapshot", "restore", str(snapshot), "--as", "t-new", "--store",
        "postgres:env:SNAPSHOT_TEST_DSN", "--artifacts", str(tmp_path / "elsewhere"),
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "postgres" in result.output.lower()
    _nothing_made(tmp_path)


def test_a_store_location_that_is_none_is_refused(made_run, tmp_path):
    snapshot = save(made_run)
    result = invoke("snapshot", "restore", str(snapshot), "--as", "t-new", "--store", "mysql:x")
    _refused(result, "--store")
    _nothing_made(tmp_path)


def test_a_directory_that_is_no_snapshot_is_refused(tmp_path):
    _refused(invoke("snapshot", "restore", str(tmp_path), "--as", "t-new"), "is not a snapshot")


# --- process snapshots (CRIU)


@pytest.mark.skipif(criu_problem() is None, reason="CRIU works here: nothing to refuse")
def test_process_snapshots_are_refused_where_criu_cannot_run(
    config_file, base_config, rollout_cache
):
    base_config["snapshot"] = {"process": True}
    with pytest.raises(PlanError) as raised:
        build_plan(config_file(base_config))
    (issue,) = [i for i in raised.value.issues if i.path == "snapshot.process"]
    assert criu_problem() in issue.message and "criu check" in issue.hint


TREE = """
import os, socket, sys, time
server = socket.create_server(("127.0.0.1", 0))
port = server.getsockname()[1]
if os.fork() == 0:
    client = socket.create_connection(("127.0.0.1", port))
    while not os.path.exists(sys.argv[1]):
        client.sendall(b"x"); time.sleep(0.05)
    os._exit(0)
peer, _ = server.accept()
while not os.path.exists(sys.argv[1]):
    peer.recv(1); time.sleep(0.05)
"""


@pytest.mark.skipif(criu_problem() is not None, reason=f"no usable CRIU here: {criu_problem()}")
def test_a_process_tree_with_a_tcp_connection_is_dumped_and_restored(tmp_path):
    from rollout.executor.criu import dump_run, restore_processes
    from rollout.executor.ownership import Owner
    from rollout.executor.processes import RUN_TOKEN_ENV

    owner = Owner.this_process()
    done = tmp_path / "done"
    tree = subprocess.Popen(
        [sys.executable, "-c", TREE, str(done)],
        env={**os.environ, RUN_TOKEN_ENV: owner.token},
        start_new_session=True,
    )
    time.sleep(1)
    run = RunRecord(
        "t", "t", "running", "-", "-", str(tmp_path), 0.0, 0.0, None, None, False,
        owner=owner.to_json(),
    )  # fmt: skip
    images = tmp_path / "images"
    assert dump_run(run, images) == tree.pid
    assert list(images.glob("*.img"))
    assert tree.poll() is None  # left running
    os.killpg(tree.pid, signal.SIGKILL)
    tree.wait()
    done.touch()
    assert restore_processes(images) == 0


def test_criu_complaint_names_the_cause_not_the_failed_helper():
    # What `criu check` 3.17 prints on this project's machines (their vDSO layout).
    output = (
        "Error (criu/util.c:642): exited, status=1\n"
        "Error (criu/vdso.c:381): vdso: Unexpected rt vDSO area bounds\n"
        "Error (criu/vdso.c:613): vdso: Failed to fill self vdso symtable\n"
        "Error (criu/kerndat.c:1615): kerndat_vdso_fill_symtable failed when initializing kerndat.\n"
        "Error (criu/crtools.c:260): Could not initialize kernel features detection.\n"
    )
    assert _complaint(output) == "vdso: Unexpected rt vDSO area bounds"
    assert _complaint("(00.004) Error (criu/cr-check.c:9): needs CAP_SYS_ADMIN") == (
        "needs CAP_SYS_ADMIN"
    )
    assert _complaint("Looks bad\n") == "Looks bad"


# --- snapshots in object stores (moto S3 and the GCS emulator, over loopback)


@pytest.fixture(params=["s3", "gs"])
def bucket(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket's URL, once on S3 and once on GCS."""
    # The GCS emulator's server thread prints a traceback when a client hangs up before reading
    # its answer (gcsfs does, now and then); the CLI runner captures it as the command's output.
    handle_error = socketserver.BaseServer.handle_error

    def quiet_when_hung_up(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            handle_error(self, request, client_address)

    monkeypatch.setattr(socketserver.BaseServer, "handle_error", quiet_when_hung_up)
    return request.getfixturevalue("s3_bucket" if request.param == "s3" else "gcs_bucket")


def _object_store(url: str):
    import fsspec

    return fsspec.core.url_to_fs(url)


def test_a_snapshot_in_an_object_store_restores_like_a_local_one(made_run, tmp_path, bucket):
    remote = f"{bucket}/snap"
    result = invoke("snapshot", "save", RUN, "--store", made_run.derived.store, "--to", remote)
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1].endswith(f": {remote}")
    fs, prefix = _object_store(remote)
    assert fs.exists(f"{prefix}/{manifest.MANIFEST}")

    location = f"sqlite:{tmp_path / 'other' / 'rollout.db'}"
    result = invoke(
        "snapshot", "restore", remote, "--as", "t-new", "--store", location,
        "--artifacts", str(tmp_path / "elsewhere"),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    plan_path = Path(result.output.strip().rsplit("rollout run --plan ", 1)[1])
    plan = read_plan(plan_path)  # fresh and unedited: what `rollout run` checks
    assert plan.run_id == "t-new" and plan.derived.store == location
    assert plan.derived.artifacts == str(tmp_path / "elsewhere" / "t-new")
    restored = tmp_path / "elsewhere" / "t-new" / "step-000002"
    assert manifest.problems(restored) == []
    assert (restored / "model" / "model.safetensors").read_bytes() == (
        Path(made_run.derived.artifacts) / "step-000002/model/model.safetensors"
    ).read_bytes()
    with open_store(location, create=False) as store:
        run = store.get_run("t-new")
        assert run.plan_sha256 == json.loads(plan_path.read_text())["sha256"]
        assert run.status == "planned" and run.last_step == 2
        assert [m.step for m in store.metrics("t-new")] == [1, 2]
        assert [line.message for line in store.logs("t-new")] == ["step 2 done"]
        samples = store.samples("t-new")
        assert [x.step for x in samples] == [1, 2, 2] and math.isnan(samples[0].reward)
        assert samples[2].turns == AGENT_TURNS and samples[2].completion == "answer"
        (checkpoint,) = store.checkpoints("t-new")
        assert checkpoint.location == str(restored)


def test_a_damaged_snapshot_in_an_object_store_is_refused_naming_the_file(
    made_run, tmp_path, bucket
):
    remote = f"{bucket}/snap"
    saved = invoke("snapshot", "save", RUN, "--store", made_run.derived.store, "--to", remote)
    assert saved.exit_code == 0, saved.output
    fs, prefix = _object_store(remote)
    damaged = f"{prefix}/checkpoint/step-000002/model/model.safetensors"
    data = bytearray(fs.cat_file(damaged))
    data[100] ^= 0xFF  # same size, one byte different: only the checksum can tell
    fs.pipe_file(damaged, bytes(data))

    location = f"sqlite:{tmp_path / 'other.db'}"
    result = invoke(
        "snapshot", "restore", remote, "--as", "t-new", "--store", location,
        "--artifacts", str(tmp_path / "elsewhere"),
    )  # fmt: skip
    _refused(result, "does not match its manifest", "model.safetensors")
    _nothing_made(tmp_path, location)
    assert not Path(location.removeprefix("sqlite:")).exists()


def test_a_snapshot_to_a_bucket_that_does_not_exist_is_refused_before_copying(made_run, bucket):
    missing = f"{bucket}-missing/snap"
    result = invoke("snapshot", "save", RUN, "--store", made_run.derived.store, "--to", missing)
    _refused(result, "--to", "does not exist")
    assert "copied checkpoint" not in result.output


def test_a_restore_to_artifacts_in_a_bucket_that_does_not_exist_makes_nothing(
    made_run, tmp_path, bucket
):
    snapshot = save(made_run)
    location = f"sqlite:{tmp_path / 'other.db'}"
    result = invoke(
        "snapshot", "restore", str(snapshot), "--as", "t-new", "--store", location,
        "--artifacts", f"{bucket}-missing/runs",
    )  # fmt: skip
    _refused(result, "storage.artifacts", "does not exist")
    _nothing_made(tmp_path, location)
    assert not Path(location.removeprefix("sqlite:")).exists()


def test_a_snapshot_url_whose_endpoint_does_not_answer_is_refused_naming_it(
    made_run, tmp_path, s3_bucket, monkeypatch
):
    import s3fs

    remote = f"{s3_bucket}/snap"
    saved = invoke("snapshot", "save", RUN, "--store", made_run.derived.store, "--to", remote)
    assert saved.exit_code == 0, saved.output
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    s3fs.S3FileSystem.clear_instance_cache()  # the cached one still talks to the live server
    location = f"sqlite:{tmp_path / 'other.db'}"
    result = invoke(
        "snapshot", "restore", remote, "--as", "t-new", "--store", location,
        "--artifacts", str(tmp_path / "elsewhere"),
    )  # fmt: skip
    s3fs.S3FileSystem.clear_instance_cache()
    _refused(result, "SNAPSHOT", "cannot reach", "127.0.0.1:9")
    _nothing_made(tmp_path, location)
