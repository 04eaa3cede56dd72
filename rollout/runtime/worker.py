"""Entry point of every torchrun worker: read the plan once, take this rank's roles, train.

    python -m torch.distributed.run ... -m rollout.runtime.worker --plan RUN_DIR/plan.lock

The distributed environment is read once, here. A worker never decides the run's status (the
executor on the host does); on failure it leaves its traceback in RUN_DIR/errors/rank-N.txt and
in the run store, and exits non-zero. SIGTERM asks it to stop after the current step.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.config.algorithm import OFFLINE_KINDS
from rollout.executor.failure import error_file, fault_file, stacks_file
from rollout.executor.processes import RUN_TOKEN_ENV, die_with_parent
from rollout.planner.definition import Plan
from rollout.planner.lockfile import read_plan
from rollout.redact import redact_text
from rollout.runtime.activity import Activity, activity_file
from rollout.runtime.context import WorkerContext

if TYPE_CHECKING:
    from rollout.storage.writer import BackgroundWriter

log = logging.getLogger("rollout.worker")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout-worker")
    parser.add_argument("--plan", required=True)
    args = parser.parse_args(argv)
    if os.environ.get(RUN_TOKEN_ENV):  # started by a host: die with torchrun, never outlive it
        die_with_parent(os.getppid())

    plan = read_plan(args.plan, check_fresh=False)  # the host verified it before launch
    rank = int(os.environ.get("RANK", "0"))
    context = WorkerContext(
        plan=plan,
        rank=rank,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        activity=Activity(activity_file(plan.derived.run_dir, rank)),
    )
    fault = _dump_stacks_on_fatal_signals(plan.derived.run_dir, rank)
    stacks = _dump_stacks_on_request(plan.derived.run_dir, rank)
    signal.signal(signal.SIGTERM, lambda *_: context.stop.set())
    signal.signal(signal.SIGINT, lambda *_: context.stop.set())

    from rollout.runtime.records import Records
    from rollout.runtime.trackers import metric_sinks
    from rollout.storage.writer import BackgroundWriter, StoreLogHandler

    # Rank 0's trackers: the writer feeds them off the hot path and closes them when it closes.
    sinks = metric_sinks(plan, context.rank)
    # Into the run store, or (SQLite, a rank off node 0) forwarded to node 0 once the group forms.
    records = Records(plan, context.rank)
    writer = BackgroundWriter(records.open_store(), sinks=sinks)
    role = "+".join(context.roles)
    _configure_logging(StoreLogHandler(writer, plan.run_id, context.rank, role), plan)
    failed = True
    try:
        _setup_torch(context)
        records.connect()
        if plan.config.algorithm.kind in OFFLINE_KINDS:
            from rollout.runtime.offline.loop import train
        else:
            from rollout.runtime.online.trainer import train

        train(context, writer)
        context.uploads.wait()  # the last checkpoint is committed before the run ends
        failed = False
        return 0
    except BaseException as error:  # the traceback must reach the user, whatever it was
        # An upload in flight still ends (committed, or its failure logged) before the worker
        # does, and never in place of this error.
        context.uploads.wait_quietly()
        text = redact_text("".join(traceback.format_exception(error)))
        path = error_file(plan.derived.run_dir, context.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        log.error("rank %d failed: %s", context.rank, text)
        return 1
    finally:
        records.give_up_waiting()
        _close_quietly(writer)
        records.close(failed=failed)  # rank 0: the other nodes' last records, before the group goes
        _teardown_torch()
        _close_fault_file(fault)
        _close_stacks_file(stacks)


def _dump_stacks_on_fatal_signals(run_dir: str, rank: int):
    """A segfault or abort in native code (a plugin's C extension, say) leaves every thread's
    Python stack in errors/rank-N.fault, where the host finds the plugin's file and line."""
    path = fault_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("w", encoding="utf-8")
    faulthandler.enable(file=handle, all_threads=True)
    return handle


def _dump_stacks_on_request(run_dir: str, rank: int):
    """SIGUSR1 appends every thread's Python stack to workers/rank-N.stacks and the worker goes
    on: how to see where a run that seems hung is waiting (docs/runs.md)."""
    path = stacks_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a", encoding="utf-8")
    faulthandler.register(signal.SIGUSR1, file=handle, all_threads=True)
    return handle


def _close_fault_file(handle) -> None:
    faulthandler.disable()
    _close_unless_written(handle)


def _close_stacks_file(handle) -> None:
    faulthandler.unregister(signal.SIGUSR1)
    _close_unless_written(handle)


def _close_unless_written(handle) -> None:
    handle.close()
    path = Path(handle.name)
    if path.stat().st_size == 0:  # nothing happened: leave no empty file to puzzle over
        path.unlink()


def _close_quietly(writer: BackgroundWriter) -> None:
    """Flush what the worker recorded; a store failure must not mask the worker's own outcome."""
    try:
        writer.close()
    except Exception as error:  # the run store is unreachable: say so where the host can see it
        print(f"rollout worker: could not write to the run store: {error}", file=sys.stderr)


def _configure_logging(handler: logging.Handler, plan: Plan) -> None:
    level = getattr(logging, plan.config.logging.level.upper())
    handler.setLevel(level)
    root = logging.getLogger("rollout")
    root.setLevel(level)
    root.addHandler(handler)
    root.propagate = False


def _setup_torch(context: WorkerContext) -> None:
    import torch

    torch.set_num_threads(context.plan.derived.threads_per_process)
    from rollout.runtime.determinism import make_deterministic  # same plan, same run

    # Seeded by its index among its role's ranks: learner i (and actor i) of a disaggregated
    # run draw what colocated rank i draws.
    make_deterministic(context.plan.seeds.per_rank[context.seed_index])
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    if context.device.startswith("cuda"):
        torch.cuda.set_device(context.local_rank)
    from rollout.runtime import transport

    transport.join_process_group(
        context.world_size,
        context.plan.graph.backend,
        context.local_rank,
        timeout_s=context.plan.config.cluster.collective_timeout_s,
    )


def _teardown_torch() -> None:
    if "torch" not in sys.modules:  # it never started: nothing to leave, and no torch to import
        return
    from rollout.runtime import transport

    transport.leave_process_group()


if __name__ == "__main__":
    sys.exit(main())
