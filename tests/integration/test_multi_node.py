"""Multi-node runs as users start them: one `rollout run --plan plan.lock --node-rank K` per node,
here two "nodes" on this machine meeting at a loopback endpoint (cluster.rdzv_loopback), gloo,
the tiny model, recording into Postgres (the store every node reaches) or into node 0's SQLite
file (node 1's records forwarded to it, node 0's stop announced to node 1 at the rendezvous).

Each test starts Python and torch in several processes: marked slow. The Postgres tests skip,
saying why, where no server answers (tests/conftest.py postgres_server).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from rollout.executor.rendezvous import free_port
from rollout.storage import open_store
from tests.conftest import STORE_DSN_ENV
from tests.integration.driver import rollout, start

pytestmark = pytest.mark.slow

STALL_REWARD = """
import os
import time

CALLS = [0]


def stall(prompts, completions, **_):
    # Rank 1 stalls on its second call (step 2), far past the collective timeout.
    CALLS[0] += 1
    if os.environ.get("RANK") == "1" and CALLS[0] == 2:
        time.sleep(120)
    return [0.0 for _ in completions]
"""


POSTGRES = ("storage.backend=postgres", f"storage.postgres_dsn=env:{STORE_DSN_ENV}")


def plan_two_nodes(
    workdir: Path, name: str, *settings: str, store: tuple[str, ...] = POSTGRES
) -> tuple[Path, int]:
    """A plan.lock of grpo-tiny on two nodes of one process each, meeting on 127.0.0.1."""
    port = free_port()
    changes = [
        "cluster.nnodes=2",
        f"cluster.rdzv_endpoint=127.0.0.1:{port}",
        "cluster.rdzv_loopback=true",
        *store,
        f"run.name={name}",
        "algorithm.max_steps=2",
        "data.eval=null",
        "checkpoint.interval=2",
        *settings,
    ]
    lock = workdir / f"{name}.lock"
    args = [arg for change in changes for arg in ("--set", change)]
    result = rollout(workdir, "plan", "--config", "examples/grpo-tiny.toml", "-o", str(lock), *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--node-rank K" in result.stdout  # the next step names the flag
    return lock, port


def processes_of(workdir: Path, marker: str) -> list[psutil.Process]:
    """Live processes (not zombies) started in this test's `workdir` whose command line mentions
    `marker` (a run's name). The working directory keeps out other processes that happen to carry
    the same word (a CI harness's own script once did)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status", "cwd"]):
        if process.pid == os.getpid() or process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if process.info["cwd"] != os.path.realpath(workdir):
            continue  # not started by this test (or not ours to read: cwd is None)
        if marker in " ".join(process.info["cmdline"] or []):
            found.append(process)
    return found


def assert_none_left(workdir: Path, marker: str, within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while processes_of(workdir, marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [(p.pid, " ".join(p.cmdline())[:160]) for p in processes_of(workdir, marker)]
    assert not left, f"processes of the run outlived it: {left}"


def the_run(location: str):
    store = open_store(location, create=False)
    (record,) = store.list_runs()
    return store, record


def test_two_nodes_train_one_run_that_node_0_owns(workdir, postgres_location):
    lock, _ = plan_two_nodes(workdir, "two-nodes")
    joining = start(workdir, "run", "--plan", str(lock), "--node-rank", "1")
    owner = rollout(workdir, "run", "--plan", str(lock), "--node-rank", "0", timeout=400)
    joined_out, joined_err = joining.communicate(timeout=120)
    assert owner.returncode == 0, owner.stdout + owner.stderr
    assert joining.returncode == 0, joined_out + joined_err
    assert "finished (node 1 done)" in joined_out

    store, record = the_run(postgres_location)  # one run record, node 0's
    assert record.status == "finished" and record.last_step == 2
    assert [m.step for m in store.metrics(record.run_id, ["reward/mean"])] == [1, 2]
    # Both ranks worked: rank 1 (node 1) logged into the same store, and the checkpoint rank 0
    # wrote holds the data cursor each rank advanced through its own share of the prompts.
    ranks = {row.rank for row in store.logs(record.run_id, limit=1000)}
    assert ranks == {0, 1}
    (checkpoint,) = Path(record.run_dir).glob("checkpoints/step-000002")
    state = json.loads((checkpoint / "trainer.json").read_text())["trainer_state"]
    assert state["cursor"]["1"]["position"] == state["cursor"]["0"]["position"] > 0
    assert (Path(record.run_dir) / "torchrun-node-1.log").exists()
    store.close()
    assert_none_left(workdir, "two-nodes")


def test_two_nodes_on_sqlite_forward_node_1s_records_into_node_0s_file(workdir):
    """Node 1 never opens the SQLite file: its worker's rows travel through the rendezvous's
    store, and rank 0 writes them into node 0's file, once each, before the run ends."""
    sqlite_path = workdir / "node0" / "rollout.db"
    lock, _ = plan_two_nodes(
        workdir,
        "sqlite-nodes",
        store=("storage.backend=sqlite", f"storage.sqlite_path={sqlite_path}"),
    )
    joining = start(workdir, "run", "--plan", str(lock), "--node-rank", "1")
    owner = rollout(workdir, "run", "--plan", str(lock), "--node-rank", "0", timeout=400)
    joined_out, joined_err = joining.communicate(timeout=120)
    assert owner.returncode == 0, owner.stdout + owner.stderr
    assert joining.returncode == 0, joined_out + joined_err
    assert "records forwarded to node 0" in " ".join(joined_out.split())

    store, record = the_run(f"sqlite:{sqlite_path}")  # one run record, node 0's
    assert record.status == "finished" and record.last_step == 2
    rows = store.metrics(record.run_id)
    assert len(rows) == len({(m.name, m.step) for m in rows}) > 0  # no metric row twice
    assert [m.step for m in store.metrics(record.run_id, ["reward/mean"])] == [1, 2]
    logs = store.logs(record.run_id, limit=5000)
    assert {row.rank for row in logs if row.role != "forwarder"} == {0, 1}
    node_1 = [row.message for row in logs if row.rank == 1]
    assert len(node_1) == len(set(node_1)) > 0  # rank 1's lines, none of them twice
    (said,) = [row.message for row in logs if row.role == "forwarder"]
    assert "of rank(s) 1 from their nodes; 0 forwarding keys left" in said, said
    assert int(said.split()[1]) >= len(node_1)  # rank 1's lines came the forwarded way
    store.close()
    assert not (workdir / "runs" / "rollout.db").exists()  # nobody opened a store elsewhere
    assert_none_left(workdir, "sqlite-nodes")


def test_an_actor_on_node_0_and_its_learner_on_node_1_train_one_run(workdir):
    """A disaggregated placement across nodes: the learner (rank 1, node 1) records the metrics
    and the checkpoint, which reach node 0's SQLite file the forwarded way; the joining node's
    terminal shows no C++ trace when node 0's rendezvous store goes away first."""
    sqlite_path = workdir / "node0" / "rollout.db"
    lock, _ = plan_two_nodes(
        workdir,
        "split-nodes",
        "cluster.placement={ actor = [0], learner = [1] }",
        store=("storage.backend=sqlite", f"storage.sqlite_path={sqlite_path}"),
    )
    joining = start(workdir, "run", "--plan", str(lock), "--node-rank", "1")
    owner = rollout(workdir, "run", "--plan", str(lock), "--node-rank", "0", timeout=400)
    joined_out, joined_err = joining.communicate(timeout=120)
    assert owner.returncode == 0, owner.stdout + owner.stderr
    assert joining.returncode == 0, joined_out + joined_err
    assert "frame #" not in joined_out + joined_err and "Traceback" not in joined_err

    store, record = the_run(f"sqlite:{sqlite_path}")
    assert record.status == "finished" and record.last_step == 2
    assert [m.step for m in store.metrics(record.run_id, ["train/loss"])] == [1, 2]
    assert [m.step for m in store.metrics(record.run_id, ["perf/weight_sync_s"])] == [1, 2]
    assert [c.step for c in store.checkpoints(record.run_id)] == [2]
    roles = {(row.rank, row.role) for row in store.logs(record.run_id, limit=5000)}
    assert (1, "learner") in roles and any(rank == 0 for rank, _ in roles)
    store.close()
    assert_none_left(workdir, "split-nodes")


def test_a_cancel_on_a_sqlite_run_reaches_the_joining_node_through_node_0s_board(workdir):
    """Node 1 cannot read the run's record: node 0's host tells it, at the rendezvous store,
    that the run was cancelled, and both nodes stop."""
    sqlite_path = workdir / "node0" / "rollout.db"
    store_settings = ("storage.backend=sqlite", f"storage.sqlite_path={sqlite_path}")
    lock, _ = plan_two_nodes(
        workdir, "sqlite-cancel", "algorithm.max_steps=50", store=store_settings
    )
    joining = start(workdir, "run", "--plan", str(lock), "--node-rank", "1")
    owner = start(workdir, "run", "--plan", str(lock), "--node-rank", "0")
    deadline = time.monotonic() + 240
    run_id = None
    while time.monotonic() < deadline:  # until a step is recorded
        assert owner.poll() is None and joining.poll() is None, owner.communicate()
        if sqlite_path.exists():
            with open_store(f"sqlite:{sqlite_path}") as store:
                runs = store.list_runs()
                if runs and (runs[0].last_step or 0) >= 1:
                    run_id = runs[0].run_id
                    break
        time.sleep(0.5)
    assert run_id is not None
    cancel = rollout(workdir, "runs", "cancel", run_id, "--store", f"sqlite:{sqlite_path}")
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    _, owner_err = owner.communicate(timeout=120)
    joined_out, joined_err = joining.communicate(timeout=120)
    assert owner.returncode == 130, owner_err
    assert joining.returncode == 130, joined_out + joined_err
    assert "stopped (node 1)" in joined_err
    store, record = the_run(f"sqlite:{sqlite_path}")
    assert record.status == "stopped" and (record.last_step or 0) < 50
    store.close()
    assert_none_left(workdir, "sqlite-cancel")


def test_a_rendezvous_missing_a_node_fails_within_its_timeout_naming_it(workdir, postgres_location):
    lock, port = plan_two_nodes(workdir, "alone", "cluster.rdzv_timeout_s=3")
    began = time.monotonic()
    result = rollout(workdir, "run", "--plan", str(lock), timeout=120)  # node 0; node 1 never
    took = time.monotonic() - began
    assert result.returncode == 1, result.stdout + result.stderr
    error = " ".join(result.stderr.split())
    assert "the run's 2 nodes did not meet" in error
    assert f"127.0.0.1:{port}" in error and "missing: node 1" in error
    assert "--node-rank K" in error and "rdzv_timeout_s = 3 s" in error
    # 3 s of waiting, plus starting Python and torch twice on a busy 2-core machine
    assert took < 60, took
    store, record = the_run(postgres_location)
    assert record.status == "failed" and "did not meet" in (record.error or "")
    store.close()
    assert_none_left(workdir, "alone")

    # And node 1 alone: it never reaches node 0, says so, and leaves nothing either.
    joining = rollout(workdir, "run", "--plan", str(lock), "--node-rank", "1", timeout=120)
    assert joining.returncode == 1, joining.stdout + joining.stderr
    assert "node 1 could not reach node 0" in " ".join(joining.stderr.split())
    assert_none_left(workdir, "alone")


def test_a_joining_node_killed_mid_run_leaves_nothing_and_node_0_fails_the_run(
    workdir, postgres_location
):
    lock, _ = plan_two_nodes(
        workdir, "killed", "algorithm.max_steps=50", "cluster.collective_timeout_s=15"
    )
    joining = start(workdir, "run", "--plan", str(lock), "--node-rank", "1")
    owner = start(workdir, "run", "--plan", str(lock), "--node-rank", "0")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # until a step is recorded
        assert owner.poll() is None and joining.poll() is None, owner.communicate()
        with open_store(postgres_location) as store:
            runs = store.list_runs()
            if runs and (runs[0].last_step or 0) >= 1:
                break
        time.sleep(0.5)
    workers = [p for p in processes_of(workdir, "killed") if p.pid not in (joining.pid, owner.pid)]
    joining.send_signal(signal.SIGKILL)  # node 1's host dies; its torchrun and worker with it
    joining.wait()
    _, owner_err = owner.communicate(timeout=120)
    assert owner.returncode == 1, owner_err
    store, record = the_run(postgres_location)
    assert record.status == "failed" and record.error
    store.close()
    assert_none_left(workdir, "killed")
    assert len(workers) >= 4  # two torchrun agents and two workers were there to outlive it


def test_a_stalled_rank_ends_the_run_after_the_collective_timeout_naming_rank_role_step(
    workdir, monkeypatch
):
    """One node, two ranks: rank 1 stalls in its reward at step 2; rank 0 gives up waiting in
    the gradient all-reduce after collective_timeout_s, and the run says who waited where and
    where rank 1 was."""
    (workdir / "examples" / "stall.py").write_text(STALL_REWARD)
    monkeypatch.setenv("ROLLOUT_STOP_GRACE_S", "3")  # torchrun's SIGTERM-to-SIGKILL wait too
    began = time.monotonic()
    result = rollout(
        workdir,
        "run",
        "--config",
        "examples/grpo-tiny.toml",
        *("--set", "cluster.nproc_per_node=2", "--set", "algorithm.max_steps=3"),
        *("--set", "rewards=[{ fn = './stall.py:stall', timeout_s = 300 }]"),
        *("--set", "cluster.collective_timeout_s=4", "--set", "data.eval=null"),
        *("--set", "run.name=stalled"),
        timeout=300,
    )
    took = time.monotonic() - began
    assert result.returncode == 1, result.stdout + result.stderr
    error = " ".join(result.stderr.split())
    assert "rank 0 (actor+reward+learner) at step 2 waited longer than" in error
    assert "cluster.collective_timeout_s = 4 s" in error
    assert "Last seen: rank 1 (actor+reward+learner) at step 2 inside reward 'stall'" in error
    assert took < 100, took  # not the 120 s rank 1 would have stalled for
    assert_none_left(workdir, "stalled")
