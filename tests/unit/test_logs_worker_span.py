"""`rollout logs tail --worker` and `--span`: lines written through the workers' real log path
(StoreLogHandler -> BackgroundWriter -> run store) inside PhaseClock phases and spans, read back
by the CLI, on SQLite and Postgres."""

from __future__ import annotations

import logging
import time

import pytest
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.planner.builder import build_plan
from rollout.planner.definition import HardwareFacts
from rollout.planner.lockfile import write_plan
from rollout.runtime.phases import PhaseClock
from rollout.storage import open_store
from rollout.storage.writer import BackgroundWriter, StoreLogHandler
from rollout.tracing import current_span, span

runner = CliRunner()
RUN = "grpo-tiny-20260101-000000-abc123"
GIB = 1024**3
LAPTOP = HardwareFacts(
    platform="test", cpu_count=8, memory_bytes=16 * GIB, memory_available_bytes=12 * GIB
)


def _log_through_a_worker_handler(location: str, rank: int, role: str) -> None:
    """What a worker does: a logger whose handler queues lines for the background writer."""
    logger = logging.getLogger(f"test.rollout.worker.{rank}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    with BackgroundWriter(lambda: open_store(location)) as writer:
        handler = StoreLogHandler(writer, RUN, rank, role)
        logger.addHandler(handler)
        try:
            logger.info("before any phase")
            clock = PhaseClock("cpu")
            with clock.phase("rollout"):
                with span("generate"):
                    logger.info("sampling rank %d", rank)
                logger.info("back in rollout")
            with clock.phase("learn"):
                logger.info("loss went down on rank %d", rank)
            with span("checkpoint", step=1):
                logger.info("saved")
            logger.info("after the step")
        finally:
            logger.removeHandler(handler)


@pytest.fixture
def location(store_location, tmp_path):
    with open_store(store_location) as store:
        store.create_run(RUN, name="t", plan_sha256="x", plan_path="/p/plan.lock", run_dir="/p")
    for rank, role in ((0, "actor+learner"), (1, "actor+learner")):
        _log_through_a_worker_handler(store_location, rank, role)
    return store_location


def tail(location, *args):
    result = runner.invoke(
        app, ["logs", "tail", RUN, "--store", location, "-n", "100", *args], env={"COLUMNS": "200"}
    )
    if result.exit_code != 0:
        return result, []
    return result, [line.split(maxsplit=3)[3] for line in result.output.splitlines()]


def test_the_current_span_is_the_innermost_and_resets():
    assert current_span() is None
    with span("outer"):
        with span("inner"):
            assert current_span() == "inner"
        assert current_span() == "outer"
    assert current_span() is None


def test_span_keeps_the_lines_of_one_phase(location):
    result, lines = tail(location, "--span", "learn")
    assert result.exit_code == 0, result.output
    assert lines == ["loss went down on rank 0", "loss went down on rank 1"]
    assert "0/actor+learner/learn" in result.output  # where a line came from shows its span
    _, nested = tail(location, "--span", "generate")
    assert nested == ["sampling rank 0", "sampling rank 1"]  # the innermost span, not rollout
    _, outer = tail(location, "--span", "rollout", "--rank", "1")
    assert outer == ["back in rollout"]
    _, saved = tail(location, "--span", "checkpoint")
    assert saved == ["saved", "saved"]
    _, unknown = tail(location, "--span", "no-such-span")
    assert unknown == []


def test_lines_outside_every_span_have_none(location):
    with open_store(location) as store:
        lines = store.logs(RUN)
    outside = {line.message for line in lines if line.span is None}
    assert outside == {"before any phase", "after the step"}


def test_worker_by_global_rank(location):
    result, lines = tail(location, "--worker", "1", "--span", "learn")
    assert result.exit_code == 0, result.output
    assert lines == ["loss went down on rank 1"]


@pytest.mark.parametrize(
    ("worker", "says"),
    [("one", "is a global rank (3) or a node and its local rank"), ("1/x", "global rank")],
)
def test_a_malformed_worker_is_a_user_error(location, worker, says):
    result, _ = tail(location, "--worker", worker)
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output


def test_worker_and_rank_that_disagree_are_refused(location):
    result, _ = tail(location, "--worker", "1", "--rank", "0")
    assert result.exit_code == 2
    assert "names rank 1, but --rank asks for rank 0" in result.output


def test_node_and_local_rank_without_the_plan_says_to_use_the_global_rank(location):
    result, _ = tail(location, "--worker", "1/0")
    assert result.exit_code == 2, result.output
    assert "--worker RANK" in result.output and "Traceback" not in result.output


def test_worker_by_node_and_local_rank_reads_the_runs_plan(
    config_file, base_config, tmp_path, sqlite_only_location
):
    """Two nodes of two processes each: 1/0 is global rank 2, found in the run's plan.lock."""
    config = {
        **base_config,
        "cluster": {
            "device": "cpu",
            "nnodes": 2,
            "nproc_per_node": 2,
            "rdzv_endpoint": "node0.example:29500",
        },
    }
    config["run"]["output_dir"] = str(tmp_path / "runs")
    config["algorithm"]["rollout_batch_size"] = 16  # 4 actor processes share it evenly
    plan = build_plan(config_file(config), hardware=LAPTOP)
    lock = tmp_path / "plan.lock"
    write_plan(plan, lock)
    placed = {(p.node, p.local_rank): p.rank for p in plan.graph.processes}
    assert placed[(1, 0)] not in (0, 1)  # the case is only telling if 1/0 is not rank 1 or 0
    location = sqlite_only_location
    with open_store(location) as store:
        store.create_run(RUN, name="t", plan_sha256="x", plan_path=str(lock), run_dir="/p")
        now = time.time()
        store.add_logs(
            [(RUN, now, "info", rank, "actor+learner", f"from {rank}") for rank in range(4)]
        )
    result, lines = tail(location, "--worker", "1/0")
    assert result.exit_code == 0, result.output
    assert lines == [f"from {placed[(1, 0)]}"]
    missing, _ = tail(location, "--worker", "5/0")
    assert missing.exit_code == 2
    assert "no worker 5/0 in this run's plan" in missing.output
    assert "1/1" in missing.output  # it lists the workers there are


@pytest.fixture
def sqlite_only_location(tmp_path):
    return f"sqlite:{tmp_path / 'store.db'}"
