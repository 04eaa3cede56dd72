"""One owner per run: a lock on the run directory and a lease in the run store.

Starting a run takes, in order:

1. an exclusive `flock` on `<run_dir>/owner.lock`, which the kernel releases when the process
   ends, however it ends, so it is never stale; a second `rollout run` of the same plan on this
   machine is refused at once, naming the process that holds it;
2. the run's lease in the run store (`RunStore.claim_run`, one transaction), which also covers
   hosts that do not share a disk but share a store.

While the run goes, a heartbeat thread renews the lease every `lease_s / 6` seconds. A host that
stops renewing (killed, frozen, its machine gone) leaves a lease that runs out: readers then mark
the run 'lost' (`reconcile`), and `logs tail --follow` ends. On this machine a reader needs no
wait: an owner whose process is gone is lost at once. A host that finds its lease taken over
(it was frozen longer than the lease) must stop its workers at once: another host owns the run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from rollout.errors import Issue, RolloutError
from rollout.executor.processes import new_token, proc_stat
from rollout.storage.base import RunStore

LEASE_ENV = "ROLLOUT_LEASE_S"
DEFAULT_LEASE_S = 30.0
LOCK_FILE = "owner.lock"


def lease_seconds() -> float:
    """How long a lease lasts without renewal: $ROLLOUT_LEASE_S, else 30 s."""
    try:
        return max(1.0, float(os.environ.get(LEASE_ENV, DEFAULT_LEASE_S)))
    except ValueError:
        return DEFAULT_LEASE_S


@dataclass(frozen=True)
class Owner:
    """The process that owns a run, precisely enough to tell on this machine whether it lives."""

    host: str
    boot_id: str
    pid: int
    start_ticks: int
    """The process's start time in clock ticks since boot: a reused pid has another."""
    token: str
    """Random per start; also the environment marker of the run's processes."""
    since: float

    @classmethod
    def this_process(cls) -> Owner:
        pid = os.getpid()
        return cls(
            socket.gethostname(), _boot_id(), pid, _start_ticks(pid), new_token(), time.time()
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | None) -> Owner | None:
        try:
            return cls(**json.loads(text or ""))
        except (ValueError, TypeError):
            return None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on {self.host} since {when}"

    def is_dead(self) -> bool:
        """True only when this machine can tell for sure: same host and boot, process gone."""
        if self.host != socket.gethostname() or self.boot_id != _boot_id() or not self.boot_id:
            return False
        return _start_ticks(self.pid) != self.start_ticks


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


def _start_ticks(pid: int) -> int:
    """Field 22 of /proc/PID/stat; -1 if there is no such process (or no /proc)."""
    fields = proc_stat(pid)
    return -1 if fields is None else int(fields[19])


# --- taking and keeping ownership --------------------------------------------------------------


@contextlib.contextmanager
def directory_lock(run_dir: Path, run_id: str, *, lock_name: str = LOCK_FILE) -> Iterator[Owner]:
    """Hold `<run_dir>/<lock_name>` for the block; refuse if another process holds it. Node 0,
    the run's owner, holds owner.lock; a node joining it (rollout.executor.join) a lock of its
    own, so that nodes sharing the run directory do not refuse one another."""
    run_dir.mkdir(parents=True, exist_ok=True)
    owner = Owner.this_process()
    fd = os.open(run_dir / lock_name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = Owner.from_json(os.pread(fd, 4096, 0).decode(errors="replace"))
            raise already_running(
                run_id, holder.describe() if holder else "another process"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, owner.to_json().encode(), 0)
        yield owner
    finally:
        os.close(fd)  # releases the flock


def already_running(run_id: str, holder: str) -> RolloutError:
    return RolloutError(
        Issue(
            "run id",
            f"run {run_id} is already running, owned by {holder}: a run has one owner",
            hint=f"wait for it to end, follow it with `rollout logs tail {run_id} --follow`, or "
            f"stop it with `rollout runs cancel {run_id}`",
        )
    )


def claim(store: RunStore, run_id: str, owner: Owner, lease_s: float) -> None:
    """Take the run's lease in the store, after reconciling what other owners left behind."""
    reconcile(store)
    holder = store.claim_run(run_id, owner.to_json(), lease_s=lease_s)
    if holder is not None:
        found = Owner.from_json(holder)
        raise already_running(run_id, found.describe() if found else holder)


class Heartbeat:
    """Renews the lease from a thread with its own store connection; `lost` is set, and
    `on_lost` called once, if the lease was taken over."""

    def __init__(
        self,
        open_store: Callable[[], RunStore],
        run_id: str,
        owner: Owner,
        lease_s: float,
        on_lost: Callable[[], None],
    ):
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._args = (open_store, run_id, owner.to_json(), lease_s, on_lost)
        self._thread = threading.Thread(target=self._run, name="rollout-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        open_store, run_id, owner, lease_s, on_lost = self._args
        store = open_store()
        try:
            while not self._stop.wait(lease_s / 6):
                try:
                    renewed = store.renew_lease(run_id, owner, lease_s=lease_s)
                except Exception:  # a busy or unreachable store: try again next beat
                    continue
                if not renewed:
                    self.lost.set()
                    on_lost()
                    return
        finally:
            store.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# --- readers -----------------------------------------------------------------------------------


def reconcile(store: RunStore) -> None:
    """Mark lost what no owner runs any more: expired leases anywhere, dead owners here."""
    store.expire_leases()
    for record in store.list_runs(status="running", limit=10_000):
        owner = Owner.from_json(record.owner)
        if owner is not None and owner.is_dead():
            store.mark_lost(
                record.run_id,
                record.owner or "",
                error=f"its owner ({owner.describe()}) ended without saying how the run ended "
                "(killed?); re-run the plan to resume it",
            )
