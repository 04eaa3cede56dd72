"""Run a verified plan: take ownership of the run, launch torchrun, supervise, end it.

The host never imports the runtime. In order, `run_plan`:

1. verifies the plan.lock (rollout.executor.preflight: hash, format, freshness, and every
   refusal `rollout plan` would have made);
2. takes ownership (rollout.executor.ownership): the run directory's lock, then the run's lease
   in the store; a second start of the same plan is refused with who holds it, and a plan whose
   run id belongs to another plan in the store is refused; a finished run is not started again;
3. starts the reaper and torchrun (gloo on CPU, nccl on GPU) bound to this process
   (rollout.executor.processes: no process of the run outlives it, however this one ends), as
   node 0 of the plan's nodes (rollout.executor.rendezvous: where they meet); the other nodes
   join with `rollout run --plan plan.lock --node-rank K` (rollout.executor.join);
4. polls the run store for progress and cancellation while a heartbeat renews the lease; starts
   torchrun again when an actor rank dies, within cluster.max_restarts
   (rollout.executor.restarts: every worker resumes from the newest checkpoint); on
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
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollout.errors import Issue, RolloutError
from rollout.executor.control import ControlBoard, forwards_records
from rollout.executor.failure import (
    activity_file,
    describe_failure,
    error_file,
    fault_file,
    first_death,
)
from rollout.executor.metrics import RunMetricsServer, metrics_server
from rollout.executor.ownership import Heartbeat, claim, directory_lock, lease_seconds
from rollout.executor.preflight import verify_plan
from rollout.executor.processes import RUN_TOKEN_ENV, Reaper, kill_marked
from rollout.executor.rendezvous import Rendezvous, check_node_rank, rendezvous_failure, resolve
from rollout.executor.restarts import Restarts
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
    on_metrics: Callable[[str], None] = lambda url: None
    """The run's /metrics is served at this URL ([logging] metrics_port)."""
    on_restart: Callable[[str], None] = lambda line: None
    """A rank died and every process starts again (rollout.executor.restarts): why, and which
    restart of how many."""


def run_plan(plan_path: str | Path, *, progress: Progress | None = None) -> RunRecord:
    """Verify and execute a plan as its node 0 (the node that owns the run); block until the run
    ends; return its record."""
    progress = progress or Progress()
    plan = verify_plan(plan_path)
    check_node_rank(plan, 0)
    # Bound now: a key that cannot be read or a port in use is refused before the run is
    # claimed. Served from just before the workers start; stopped however the host ends.
    metrics = _metrics_server(plan)
    try:
        return _run_verified(plan, plan_path, progress, metrics)
    finally:
        if metrics is not None:
            metrics.stop()


def _run_verified(
    plan: Plan, plan_path: str | Path, progress: Progress, metrics: RunMetricsServer | None
) -> RunRecord:
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
            heartbeat = Heartbeat(
                lambda: open_store(plan.derived.store), plan.run_id, owner, lease_s, lambda: None
            )
            try:
                plan_copy = copy_plan(Path(plan_path), run_dir)
                clear_old_reports(plan, 0)
                progress.on_start(plan, existing is not None)
                if metrics is not None:
                    metrics.start()
                    progress.on_metrics(metrics.url)
                rdzv = resolve(plan, 0)
                status, error = supervise(
                    plan,
                    plan_copy,
                    store,
                    progress,
                    owner.token,
                    rdzv,
                    _OwnerWatch(heartbeat, plan.run_id),
                    str(plan_path),
                    announce=_announcer(plan, rdzv),
                )
            finally:
                heartbeat.stop()
                store.end_run(plan.run_id, owner.to_json(), status, error=error)
            record = store.get_run(plan.run_id)
            assert record is not None
            return record
        finally:
            store.close()


@dataclass(frozen=True)
class Stop:
    """Why the host stops its workers before they end: the status and error the node reports,
    and whether at once (SIGKILL) or after the grace period (SIGTERM first)."""

    status: str
    error: str | None = None
    at_once: bool = False


class _OwnerWatch:
    """What ends node 0's run early: its lease taken over, or `rollout runs cancel`."""

    def __init__(self, heartbeat: Heartbeat, run_id: str):
        self.heartbeat = heartbeat
        self.run_id = run_id

    def __call__(self, store: RunStore | None) -> Stop | None:
        assert store is not None  # node 0 always reads the run store
        if self.heartbeat.lost.is_set():
            return Stop("lost", "another host took the run over: this one missed its lease", True)
        if _cancel_requested(store, self.run_id):
            return Stop("stopped")
        return None


def _metrics_server(plan: Plan) -> RunMetricsServer | None:
    config = plan.config.logging
    return metrics_server(
        plan.run_id,
        lambda: open_store(plan.derived.store),
        port=config.metrics_port,
        host=config.metrics_host,
        key_ref=config.metrics_key,
    )


def _announcer(plan: Plan, rdzv: Rendezvous) -> Callable[[Stop], None]:
    """How node 0 tells joining hosts that cannot read the run store (SQLite) that it stops the
    run (rollout.executor.control); with Postgres they read the run's record instead."""
    if not forwards_records(plan):
        return lambda stop: None
    board = ControlBoard(rdzv)
    return lambda stop: board.announce(stop.status, stop.error)


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


def copy_plan(plan_path: Path, run_dir: Path) -> Path:
    """The plan the workers read, in the run directory. Written whole and then renamed: on a run
    directory that several nodes share, another node's workers may be reading it."""
    plan_copy = run_dir / "plan.lock"
    if plan_path.resolve() != plan_copy.resolve():
        temp = run_dir / f".plan.lock.{os.getpid()}.tmp"
        shutil.copyfile(plan_path, temp)
        os.replace(temp, plan_copy)
    return plan_copy


def supervise(
    plan: Plan,
    plan_copy: Path,
    store: RunStore | None,
    progress: Progress,
    token: str,
    rdzv: Rendezvous,
    watch: Callable[[RunStore | None], Stop | None],
    plan_arg: str,
    *,
    announce: Callable[[Stop], None] = lambda stop: None,
) -> tuple[str, str | None]:
    """Run this node's torchrun agent to its end, starting it again after an actor rank dies
    while cluster.max_restarts allows (rollout.executor.restarts); return this node's status
    and error.

    `watch` is asked twice a second whether to stop early (a cancel, a lost lease, the run
    ended by node 0); a stop signal to this process stops the workers too, and `announce` hears
    of every early stop before the workers do. `store` is None on a joining node that cannot
    read the run store (SQLite: its progress is drawn on node 0 only). `plan_arg` is the
    plan.lock as the user named it, for messages.
    """
    run_dir = Path(plan.derived.run_dir)
    # Workers' and torchrun's own output goes to a file in the run directory: the terminal shows
    # the progress bar, the run store has the logs, and a failure is summarized from the files.
    output = run_dir / torchrun_log_name(rdzv.node_rank)
    roles = {p.rank: "+".join(p.roles) for p in plan.graph.processes}
    restarts = Restarts.of(plan, rdzv.node_rank, store)
    stops = _StopRequests(progress.on_signal)
    reaper = Reaper(token)  # one for every attempt: restarted workers carry the same token
    previous = stops.install()
    try:
        while True:
            start = output.stat().st_size if output.exists() else 0  # this attempt's part
            ended = _attempt(
                plan, plan_copy, store, progress, token, rdzv, watch, stops, output, announce
            )
            if isinstance(ended, Stop):
                return ended.status, ended.error
            if ended == 0:
                return "finished", None
            this_start = _read_from(output, start)
            met = rendezvous_failure(rdzv, this_start, plan_arg)
            if met is not None:
                return "failed", met
            death = first_death(run_dir, this_start)
            cause = describe_failure(
                run_dir,
                ended,
                output,
                roles=roles,
                collective_timeout_s=plan.config.cluster.collective_timeout_s,
                torchrun_output=this_start,
            )
            if not restarts.allows(death):
                return "failed", restarts.failure(death, cause, plan_arg, store)
            assert death is not None
            kill_marked(token)  # what the dead attempt left (a plugin's children) goes first
            progress.on_restart(restarts.record(store, death, cause))
            clear_old_reports(plan, rdzv.node_rank)
    finally:
        _restore_signals(previous)
        kill_marked(token)  # e.g. a reward plugin's children, left behind by a worker
        reaper.close()


def _attempt(
    plan: Plan,
    plan_copy: Path,
    store: RunStore | None,
    progress: Progress,
    token: str,
    rdzv: Rendezvous,
    watch: Callable[[RunStore | None], Stop | None],
    stops: _StopRequests,
    output: Path,
    announce: Callable[[Stop], None],
) -> Stop | int:
    """One start of torchrun's agent, to its end: its exit code, or why the host stopped it."""
    process = None
    try:
        with output.open("ab") as log_file:
            process = subprocess.Popen(
                _torchrun_command(plan, plan_copy, rdzv),
                start_new_session=True,  # Ctrl-C reaches the host only; the host decides
                env=_worker_environment(plan, token),
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        while process.poll() is None:
            stop = Stop("stopped") if stops.requested else watch(store)
            if stop is not None:
                announce(stop)
                if stop.at_once:
                    _kill_now(process, token)
                else:
                    _stop(process, token, stops)
                return stop
            if store is not None:
                progress.on_poll(plan, store)
            time.sleep(POLL_SECONDS)
        if store is not None:
            progress.on_poll(plan, store)
        return process.returncode
    finally:
        if process is not None and process.poll() is None:
            _kill_now(process, token)


def torchrun_log_name(node_rank: int) -> str:
    """Each node's torchrun output has a file of its own, should nodes share the run directory."""
    return "torchrun.log" if node_rank == 0 else f"torchrun-node-{node_rank}.log"


def node_ranks(plan: Plan, node_rank: int) -> list[int]:
    """The global ranks of the plan's processes on node `node_rank`."""
    return [p.rank for p in plan.graph.processes if p.node == node_rank]


def _read_from(path: Path, offset: int) -> str:
    with contextlib.suppress(OSError), path.open("rb") as file:
        file.seek(offset)
        return file.read().decode("utf-8", errors="replace")
    return ""


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
        # torchrun's own wait between SIGTERM and SIGKILL when it ends its workers (a rank
        # failed, or the host stopped it): the same grace as the host's, one knob for both.
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(max(1, round(stop_grace_seconds()))),
    }


def _torchrun_command(plan: Plan, plan_copy: Path, rdzv: Rendezvous) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rollout.executor.torchrun",
        str(os.getpid()),
        "--",
        *rdzv.torchrun_args(),
        f"--nproc_per_node={plan.graph.nproc_per_node}",
        # The host restarts (rollout.executor.restarts): torchrun's own restarts cannot tell an
        # actor's death (restart) from a learner's (fail).
        "--max_restarts=0",
        "--monitor_interval=0.5",
        "--module",
        "rollout.runtime.worker",
        "--plan",
        str(plan_copy),
    ]


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


def clear_old_reports(plan: Plan, node_rank: int) -> None:
    """What this node's workers reported in an earlier attempt (errors, activity) is not this
    attempt's. Only this node's ranks' files: another node may share the run directory."""
    run_dir = Path(plan.derived.run_dir)
    for rank in node_ranks(plan, node_rank):
        for path in (
            error_file(run_dir, rank),
            fault_file(run_dir, rank),
            activity_file(run_dir, rank),
        ):
            path.unlink(missing_ok=True)


def _lock_sha256(path: Path) -> str:
    return json.loads(path.read_text(encoding="utf-8"))["sha256"]
