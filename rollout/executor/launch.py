"""Run a verified plan: launch torchrun, forward signals, own the run's status.

The host never imports the runtime: it starts `torch.distributed.run` (gloo on CPU, nccl on GPU)
in its own process group, polls the run store for progress and cancellation, and on Ctrl-C,
SIGTERM or a cancel request stops the whole group (SIGTERM, a grace period, then SIGKILL), so no
worker outlives the run. The first worker failure's traceback becomes the run's error.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollout.errors import Issue, RolloutError
from rollout.executor.preflight import verify_plan
from rollout.planner.definition import Plan
from rollout.storage import open_store
from rollout.storage.base import RunRecord, RunStore

GRACE_SECONDS = 30.0
POLL_SECONDS = 0.5
RUNNABLE_KINDS = ("grpo", "rloo", "reinforce_pp", "ppo", "dpo", "ipo", "kto", "sft", "rm")


@dataclass
class Progress:
    """What the host reports while a run goes: called about twice a second."""

    on_start: Callable[[Plan, bool], None] = lambda plan, resumed: None
    on_poll: Callable[[Plan, RunStore], None] = lambda plan, store: None


def run_plan(plan_path: str | Path, *, progress: Progress | None = None) -> RunRecord:
    """Verify and execute a plan; block until the run ends; return its record."""
    progress = progress or Progress()
    plan = verify_plan(plan_path)
    _check_runnable(plan)
    run_dir = Path(plan.derived.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    plan_copy = run_dir / "plan.lock"
    if Path(plan_path).resolve() != plan_copy.resolve():
        shutil.copyfile(plan_path, plan_copy)
    _clear_old_errors(run_dir)

    store = open_store(plan.derived.store)
    try:
        existing = store.get_run(plan.run_id)
        if existing is None:
            store.create_run(
                plan.run_id,
                name=plan.config.run.name,
                plan_sha256=_lock_sha256(plan_copy),
                plan_path=str(plan_copy),
                run_dir=str(run_dir),
            )
        store.set_status(plan.run_id, "running")
        progress.on_start(plan, existing is not None)
        status, error = _supervise(plan, plan_copy, store, progress)
        store.set_status(plan.run_id, status, error=error)
        record = store.get_run(plan.run_id)
        assert record is not None
        return record
    finally:
        store.close()


def _check_runnable(plan: Plan) -> None:
    kind = plan.config.algorithm.kind
    if kind not in RUNNABLE_KINDS:
        raise RolloutError(
            Issue(
                "algorithm.kind",
                f"this version of rollout executes {', '.join(RUNNABLE_KINDS)}; {kind} plans "
                "validate and plan but do not run yet",
                value=kind,
                hint=f"use one of: {', '.join(RUNNABLE_KINDS)}",
            )
        )
    if plan.graph.nnodes > 1 or any(e.transport != "in_process" for e in plan.graph.edges):
        raise RolloutError(
            Issue(
                "cluster.placement",
                "this version runs colocated placements on one node only",
                hint="remove cluster.placement and set nnodes = 1",
            )
        )


def _supervise(
    plan: Plan, plan_copy: Path, store: RunStore, progress: Progress
) -> tuple[str, str | None]:
    # Workers' and torchrun's own output goes to a file in the run directory: the terminal shows
    # the progress bar, the run store has the logs, and a failure's traceback is reported below.
    output = Path(plan.derived.run_dir) / "torchrun.log"
    with output.open("ab") as log_file:
        process = subprocess.Popen(
            _torchrun_command(plan, plan_copy),
            start_new_session=True,  # its own process group: one signal reaches every worker
            env=_worker_environment(plan),
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    stop_reason: list[str] = []
    previous = _forward_signals(lambda name: stop_reason.append(name))
    try:
        while process.poll() is None:
            if stop_reason or _cancel_requested(store, plan.run_id):
                _stop_group(process)
                return "stopped", None
            progress.on_poll(plan, store)
            time.sleep(POLL_SECONDS)
        progress.on_poll(plan, store)
    finally:
        _restore_signals(previous)
        if process.poll() is None:
            _stop_group(process)
    if process.returncode == 0:
        return "finished", None
    return "failed", _first_failure(Path(plan.derived.run_dir), process.returncode, output)


def _worker_environment(plan: Plan) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(plan.derived.threads_per_process),
        # Everything a worker loads was located at plan time: it never reaches for a hub.
        "HF_HUB_OFFLINE": "1",
        # The host draws the progress bar; the libraries' own bars would tear it.
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _torchrun_command(plan: Plan, plan_copy: Path) -> list[str]:
    graph = plan.graph
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={graph.nproc_per_node}",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        "--max_restarts=0",
        "--monitor_interval=0.5",
        "--module",
        "rollout.runtime.worker",
        "--plan",
        str(plan_copy),
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _forward_signals(on_signal: Callable[[str], None]) -> dict[int, object]:
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, lambda s, _f: on_signal(signal.Signals(s).name))
    return previous


def _restore_signals(previous: dict[int, object]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)  # type: ignore[arg-type]


def _cancel_requested(store: RunStore, run_id: str) -> bool:
    record = store.get_run(run_id)
    return bool(record and record.cancel_requested)


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the whole group (workers finish their step and exit), then SIGKILL after a grace."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=GRACE_SECONDS)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # anything still alive in the group, children too
    process.wait()


def _clear_old_errors(run_dir: Path) -> None:
    errors = run_dir / "errors"
    if errors.is_dir():
        shutil.rmtree(errors)


def _first_failure(run_dir: Path, returncode: int, output: Path) -> str:
    files = sorted((run_dir / "errors").glob("rank-*.txt"), key=lambda p: p.stat().st_mtime)
    if files:
        return f"{files[0].stem}: " + files[0].read_text(encoding="utf-8")
    return (
        f"torchrun exited with code {returncode} before any worker reported an error; "
        f"its output is in {output}"
    )


def _lock_sha256(path: Path) -> str:
    import json

    return json.loads(path.read_text(encoding="utf-8"))["sha256"]
