"""Several nodes, before anything runs: where they meet (config rules), which store they share (node
0's SQLite file, the others forwarding to it, or Postgres), which node a command is (--node-rank), and what the run says when they
do not meet or a collective times out (from torchrun's output and the workers' files)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.config import validate_config
from rollout.errors import ConfigError
from rollout.executor.control import forwards_records
from rollout.executor.failure import activity_file, describe_failure, error_file
from rollout.executor.rendezvous import Rendezvous, rendezvous_failure, resolve
from rollout.planner.builder import build_plan
from rollout.planner.definition import HardwareFacts
from rollout.planner.lockfile import write_plan
from rollout.runtime.records import Records
from tests.conftest import STORE_DSN_ENV

GIB = 1024**3
LAPTOP = HardwareFacts(
    platform="test", cpu_count=8, memory_bytes=16 * GIB, memory_available_bytes=12 * GIB
)
runner = CliRunner()


def _issues(raw: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        validate_config(raw)
    return {issue.path: f"{issue.message} {issue.hint or ''}" for issue in caught.value.issues}


def _with_cluster(base_config: dict, **cluster) -> dict:
    return {**base_config, "cluster": {"device": "cpu", **cluster}}


def test_several_nodes_need_an_endpoint(base_config):
    issues = _issues(_with_cluster(base_config, nnodes=2))
    assert "must meet somewhere" in issues["cluster.rdzv_endpoint"]
    assert "SLURM" in issues["cluster.rdzv_endpoint"]


@pytest.mark.parametrize("endpoint", ["127.0.0.1:29500", "localhost:29500", "[::1]:29500"])
def test_a_loopback_endpoint_with_several_nodes_needs_the_opt_in(base_config, endpoint):
    issues = _issues(_with_cluster(base_config, nnodes=2, rdzv_endpoint=endpoint))
    assert "loopback" in issues["cluster.rdzv_endpoint"]
    assert "rdzv_loopback = true" in issues["cluster.rdzv_endpoint"]
    validate_config(
        _with_cluster(base_config, nnodes=2, rdzv_endpoint=endpoint, rdzv_loopback=True)
    )


def test_the_loopback_opt_in_alone_means_nothing_and_is_refused(base_config):
    issues = _issues(_with_cluster(base_config, rdzv_loopback=True))
    assert "would be ignored" in issues["cluster.rdzv_loopback"]
    issues = _issues(
        _with_cluster(base_config, nnodes=2, rdzv_endpoint="node0:29500", rdzv_loopback=True)
    )
    assert "no loopback endpoint" in issues["cluster.rdzv_loopback"]


@pytest.mark.parametrize(
    ("endpoint", "says"),
    [("node0", "HOST:PORT"), ("node0:", "HOST:PORT"), ("node0:70000", "between 1 and 65535")],
)
def test_an_endpoint_is_host_and_port(base_config, endpoint, says):
    issues = _issues(_with_cluster(base_config, nnodes=2, rdzv_endpoint=endpoint))
    assert says in issues["cluster.rdzv_endpoint"]


def test_several_nodes_on_a_sqlite_store_plan_and_forward_to_node_0(
    config_file, base_config, tmp_path
):
    """The SQLite file is node 0's: the plan builds, and the ranks off node 0 forward."""
    plan, _ = _plan_lock(
        config_file, base_config, tmp_path, nnodes=2, rdzv_endpoint="node0.example:29500"
    )
    assert plan.derived.store.startswith("sqlite:/")  # resolved where it was planned
    assert forwards_records(plan)
    assert Records(plan, 1).forwarded == [1] and Records(plan, 0).forwarded == [1]
    one_node, _ = _plan_lock(config_file, base_config, tmp_path / "one")
    assert not forwards_records(one_node) and Records(one_node, 0).forwarded == []


def _plan_lock(config_file, base_config, tmp_path, **cluster):
    config = _with_cluster(base_config, **cluster)
    config["run"]["output_dir"] = str(tmp_path / "runs")
    plan = build_plan(config_file(config), hardware=LAPTOP)
    path = tmp_path / "plan.lock"
    write_plan(plan, path)
    return plan, path


def test_a_node_rank_outside_the_plan_is_refused_with_exit_2(config_file, base_config, tmp_path):
    _, path = _plan_lock(config_file, base_config, tmp_path)
    result = runner.invoke(app, ["run", "--plan", str(path), "--node-rank", "1"])
    assert result.exit_code == 2, result.output
    assert "node rank 1 is not a node of this plan" in result.output
    assert "cluster.nnodes = 1" in result.output and "Traceback" not in result.output
    negative = runner.invoke(app, ["run", "--plan", str(path), "--node-rank", "-1"])
    assert negative.exit_code == 2 and "counts from 0" in negative.output


def test_node_rank_takes_a_plan_not_a_config(config_file, base_config, tmp_path):
    config = config_file(base_config)
    result = runner.invoke(app, ["run", "--config", str(config), "--node-rank", "1"])
    assert result.exit_code == 2, result.output
    assert "every node runs the same plan.lock" in result.output


def test_a_postgres_plan_spans_the_nodes_and_numbers_their_ranks(
    config_file, base_config, tmp_path, postgres_location
):
    base_config["storage"] = {"backend": "postgres", "postgres_dsn": f"env:{STORE_DSN_ENV}"}
    base_config["algorithm"]["rollout_batch_size"] = 16  # 4 prompts: one per rank
    plan, path = _plan_lock(
        config_file,
        base_config,
        tmp_path,
        nnodes=2,
        nproc_per_node=2,
        rdzv_endpoint="127.0.0.1:29500",
        rdzv_loopback=True,
    )
    assert [(p.rank, p.node, p.local_rank) for p in plan.graph.processes] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    args = resolve(plan, 1).torchrun_args()
    assert "--node_rank=1" in args and "--rdzv_endpoint=127.0.0.1:29500" in args
    assert f"--rdzv_id={plan.run_id}" in args and "--rdzv_backend=static" in args
    assert "--rdzv_conf=timeout=300" in args
    result = runner.invoke(app, ["run", "--plan", str(path), "--node-rank", "2"])
    assert result.exit_code == 2 and "node ranks 0..1" in result.output, result.output


def test_one_node_without_an_endpoint_meets_itself_on_a_free_local_port(
    config_file, base_config, tmp_path
):
    plan, _ = _plan_lock(config_file, base_config, tmp_path)
    rdzv = resolve(plan, 0)
    assert rdzv.host == "127.0.0.1" and rdzv.port > 0 and rdzv.nnodes == 1


# --- what the run says when nodes do not meet ---------------------------------------------------

NODE_0_ALONE = (
    "torch.distributed.DistStoreError: Timed out after 4 seconds waiting for clients. "
    "1/3 clients joined."
)
NODE_1_ALONE = (
    "torch.distributed.DistNetworkError: The client socket has timed out after 3000ms while "
    "trying to connect to (10.0.0.5, 29500)."
)


def _rdzv(node_rank: int, nnodes: int = 3) -> Rendezvous:
    return Rendezvous("10.0.0.5", 29500, nnodes, node_rank, "run-1", 3.0)


def test_node_0_alone_names_the_endpoint_the_missing_nodes_and_what_to_check():
    message = rendezvous_failure(_rdzv(0), NODE_0_ALONE, "plan.lock")
    assert message is not None
    assert "10.0.0.5:29500" in message and "rdzv_timeout_s = 3 s" in message
    assert "only node 0 (this one) joined; missing: nodes 1, 2" in message
    assert "--node-rank K" in message and "firewall" in message
    two_of_three = rendezvous_failure(_rdzv(0), NODE_0_ALONE.replace("1/3", "2/3"), "p")
    assert "2 of 3 nodes joined" in (two_of_three or "")


def test_a_joining_node_that_never_reaches_node_0_says_so():
    message = rendezvous_failure(_rdzv(1), NODE_1_ALONE, "plan.lock")
    assert message is not None and message.startswith("node 1 could not reach node 0 at")
    assert "--node-rank 0" in message and "port 29500" in message
    assert rendezvous_failure(_rdzv(1), "some other failure", "plan.lock") is None


def test_a_collective_timeout_names_rank_role_step_and_where_the_others_were(tmp_path):
    error_file(tmp_path, 0).parent.mkdir(parents=True)
    error_file(tmp_path, 0).write_text(
        "Traceback (most recent call last):\n  ...\nRuntimeError: [gloo/unbound_buffer.cc:78] "
        "Timed out waiting 4000ms for recv operation to complete\n"
    )
    for rank, activity in {
        0: {"pid": 1, "step": 3, "inside": None},
        1: {"pid": 2, "step": 3, "inside": "reward 'slow' (rewards[0]: ./slow.py:slow)"},
    }.items():
        activity_file(tmp_path, rank).parent.mkdir(parents=True, exist_ok=True)
        activity_file(tmp_path, rank).write_text(json.dumps(activity))
    message = describe_failure(
        tmp_path,
        1,
        tmp_path / "torchrun.log",
        roles={0: "actor+learner", 1: "actor+learner"},
        collective_timeout_s=4,
    )
    first = message.splitlines()[0]
    assert first.startswith("rank 0 (actor+learner) at step 3 waited longer than ")
    assert "cluster.collective_timeout_s = 4 s" in first
    assert "Last seen: rank 1 (actor+learner) at step 3 inside reward 'slow'" in first
    assert "rank-0: Traceback" in message  # the traceback still follows


def test_a_worker_error_that_is_not_a_timeout_keeps_its_plain_message(tmp_path):
    error_file(tmp_path, 1).parent.mkdir(parents=True)
    error_file(tmp_path, 1).write_text("Traceback ...\nValueError: reward is NaN\n")
    message = describe_failure(tmp_path, 1, tmp_path / "torchrun.log", collective_timeout_s=4)
    assert message == "rank-1: Traceback ...\nValueError: reward is NaN\n"
