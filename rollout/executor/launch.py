"""Run a verified plan: take ownership of the run, launch torchrun, supervise, end it.

The host never imports the runtime. In order, `run_plan`:

1. verifies the plan.lock (rollout.executor.preflight: hash, format, freshness, and every
   refusal `rollout plan` would have made);
2. takes ownership (rollout.executor.ownership): the run directory's lock, then the run's lease
   in the store; a second start of the same plan is refused with who holds it, and a plan whose
   run id belongs to another plan in the store is refused; a finished run is not started again;
3. starts the reaper and torchrun (gloo on CPU, nccl on GPU) bound to this process
   (rollout.executor.processes: no process of the run outlives it, however this one ends);
4. polls the run store for progress and cancellation while a heartbeat renews the lease; on
   Ctrl-C, SIGTERM, SIGHUP (a closed terminal) or `rollout runs cancel`, stops the workers
   (SIGTERM: they checkpoint the step they finished; SIGKILL after a grace period, or at once on a
   second signal);
5. ends the run with its status and, on failure, one message saying why
   (rollout.executor.failure).
"""

from __future__ import annotations

import contextlib
import json
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
from rollout.executor.failure import describe_failure
from rollout.executor.ownership import Heartbeat, Owner, claim, directory_lock, lease_seconds
from rollout.executor.preflight import verify_plan
from rollout.executor.processes import RUN_TOKEN_ENV, Reaper, kill_marked
from rollout.planner.definition import Plan
from rollout.storage import open_store
from rollout.storage.base import RunRecord, RunStore

GRACE_ENV = "ROLLOUT_STOP_GRACE_S"
GRACE_SECONDS = 30.0
POLL_SECONDS = 0.5
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class Progress:
    """What the host reports while a run goes: called about twice a second."""

    on_start: Callable[[Plan, bool], None] = lambda plan, resumed: None
    on_poll: Callable[[Plan, RunStore], None] = lambda plan, store: None
    on_signal: Callable[[str], None] = lambda name: None
    """A stop signal arrived (SIGHUP: the terminal is gone, so print nothing more there)."""
    on_already_finished: Callable[[Plan, RunRecord], None] = lambda plan, record: None


def run_plan(plan_path: str | Path, *, progress: Progress | None = None) -> RunRecord:
    """Verify and execute a plan; block until the run ends; return its record."""
    progress = progress or Progress()
    plan = verify_plan(plan_path)
    lock_sha256 = _lock_sha256(Path(plan_path))
    run_dir = Path(plan.derived.run_dir)
    with directory_lock(run_dir, plan.run_id) as owner:
        store = open_store(plan.derived.store)
        try:
            existing = _existing_run(store, plan, lock_sha256)
            if existing is not None and existing.status == "finished":
                progress.on_already_finished(plan, existing)
                return existing
            if existing is None:
                store.create_run(
                    plan.run_id,
                    name=plan.config.run.name,
                    plan_sha256=lock_sha256,
                    plan_path=str(run_dir / "plan.lock"),
                    run_dir=str(run_dir),
                )
            lease_s = lease_seconds()
            claim(store, plan.run_id, owner, lease_s)
            status, error = "failed", "the host stopped before its workers ended"
            try:
                plan_copy = _copy_plan(Path(plan_path), run_dir)
                _clear_old_reports(run_dir)
                progress.on_start(plan, existing is not None)
                status, error = _supervise(plan, plan_copy, store, progress, owner, lease_s)
            finally:
                store.end_run(plan.run_id, owner.to_json(), status, error=error)
            record = store.get_run(plan.run_id)
            assert record is not None
            return record
        finally:
            store.close()


def _existing_run(store: RunStore, plan: Plan, lock_sha256: str) -> RunRecord | None:
    """The run this plan resumes, if any; a RolloutError if its id belongs to another plan."""
    existing = store.get_run(plan.run_id)
    if existing is not None and existing.plan_sha256 != lock_sha256:
        raise RolloutError(
            Issue(
                "run_id",
                f"run id {plan.run_id} already belongs to another plan in the run store "
                f"(its plan.lock sha256 {existing.plan_sha256[:12]}..., this one's "
                f"{lock_sha256[:12]}...): two plans never share a run",
                value=plan.run_id,
                hint="plan the config again (`rollout plan --config ...`) for a fresh run id",
            )
        )
    return existing


def _copy_plan(plan_path: Path, run_dir: Path) -> Path:
    plan_copy = run_dir / "plan.lock"
    if plan_path.resolve() != plan_copy.resolve():
        shutil.copyfile(plan_path, plan_copy)
    return plan_copy


def _supervise(
    plan: Plan,
    plan_copy: Path,
    store: RunStore,
    progress: Progress,
    owner: Owner,
    lease_s: float,
) -> tuple[str, str | None]:
    run_dir = Path(plan.derived.run_dir)
    # Workers' and torchrun's own output goes to a file in the run directory: the terminal shows
    # the progress bar, the run store has the logs, and a failure is summarized from the files.
    output = run_dir / "torchrun.log"
    stops = _StopRequests(progress.on_signal)
    reaper = Reaper(owner.token)
    heartbeat = Heartbeat(
        lambda: open_store(plan.derived.store), plan.run_id, owner, lease_s, stops.lease_lost
    )
    previous = stops.install()
    process = None
    try:
        with output.open("ab") as log_file:
            process = subprocess.Popen(
                _torchrun_command(plan, plan_copy),
                start_new_session=True,  # Ctrl-C reaches the host only; the host decides
                env=_worker_environment(plan, owner.token),
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        while process.poll() is None:
            if heartbeat.lost.is_set():
                _kill_now(process, owner.token)
                return "lost", "another host took the run over: this one missed its lease"
            if stops.requested or _cancel_requested(store, plan.run_id):
                _stop(process, owner.token, stops)
                return "stopped", None
            progress.on_poll(plan, store)
            time.sleep(POLL_SECONDS)
        progress.on_poll(plan, store)
    finally:
        _restore_signals(previous)
        if process is not None and process.poll() is None:
            _kill_now(process, owner.token)
        kill_marked(owner.token)  # e.g. a reward plugin's children, left behind by a worker
        heartbeat.stop()
        reaper.close()
    if process.returncode == 0:
        return "finished", None
    return "failed", describe_failure(run_dir, process.returncode, output)


class _StopRequests:
    """Stop signals seen so far; the host installs it for SIGINT, SIGTERM and SIGHUP."""

    def __init__(self, on_signal: Callable[[str], None]):
        self.names: list[str] = []
        self._on_signal = on_signal

    @property
    def requested(self) -> bool:
        return bool(self.names)

    def install(self) -> dict[int, object]:
        previous = {}
        for signum in STOP_SIGNALS:
            previous[signum] = signal.signal(signum, self._handle)
        return previous

    def _handle(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        self.names.append(name)
        self._on_signal(name)

    def lease_lost(self) -> None:
        self.names.append("lease lost")


def _worker_environment(plan: Plan, token: str) -> dict[str, str]:
    return {
        **os.environ,
        RUN_TOKEN_ENV: token,  # every process of the run carries it (processes.kill_marked)
        "PYTHONUNBUFFERED": "1",
        # Same plan, same run: a plugin iterating a set of strings sees one order every time.
        "PYTHONHASHSEED": "0",
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
        "rollout.executor.torchrun",
        str(os.getpid()),
        "--",
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


def _restore_signals(previous: dict[int, object]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)  # type: ignore[arg-type]


def _cancel_requested(store: RunStore, run_id: str) -> bool:
    record = store.get_run(run_id)
    return bool(record and record.cancel_requested)


def _stop(process: subprocess.Popen[bytes], token: str, stops: _StopRequests) -> None:
    """SIGTERM torchrun's group (it passes SIGTERM to the workers, which checkpoint the step they
    finished and exit); SIGKILL everything after the grace period, or at once on another
    signal (a second Ctrl-C)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    seen = len(stops.names)
    deadline = time.monotonic() + stop_grace_seconds()
    while process.poll() is None and time.monotonic() < deadline and len(stops.names) == seen:
        time.sleep(0.1)
    _kill_now(process, token)


def stop_grace_seconds() -> float:
    """How long stopping workers may take to checkpoint and exit: $ROLLOUT_STOP_GRACE_S, else 30."""
    try:
        return max(0.0, float(os.environ.get(GRACE_ENV, GRACE_SECONDS)))
    except ValueError:
        return GRACE_SECONDS


def _kill_now(process: subprocess.Popen[bytes], token: str) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    kill_marked(token)


def _clear_old_reports(run_dir: Path) -> None:
    """What workers of an earlier attempt reported (errors, activity) is not this attempt's."""
    for name in ("errors", "workers"):
        if (run_dir / name).is_dir():
            shutil.rmtree(run_dir / name)


def _lock_sha256(path: Path) -> str:
    return json.loads(path.read_text(encoding="utf-8"))["sha256"]
