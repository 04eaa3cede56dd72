"""Process snapshots with CRIU: dump a live run's torchrun tree, and restore it.

`rollout snapshot save` of a running run with `snapshot.process = true` dumps torchrun and its
workers into the snapshot's processes/ directory and leaves them running. The tree is found by
the run's token (rollout.executor.processes: every process of the run carries it): its root is
the marked process whose parent is not marked, torchrun, which leads a session of its own, so the
dump needs no --shell-job. What the tree holds decides the flags:

- `--tcp-established`: gloo's TCP connections between ranks and to torchrun's TCPStore (and a
  Postgres store's connection) are dumped as they are; restoring them needs the same addresses,
  so the dumped tree must be gone first.
- `--file-locks`: SQLite's POSIX locks on the run store.
- `--ext-unix-sk`: unix sockets whose peer is outside the tree.
- `--leave-running`: the run goes on; the images are of one instant of it.

`restore_processes` runs `criu restore` with the caller as the tree's parent (not detached: the
workers die with their parent, rollout.executor.processes.die_with_parent, and CRIU restores that
request too), and returns when the tree ends. The restored processes keep their pids, files and
paths: restore on the host that dumped them, with the run directory in place and the dumped
processes gone.

Only where `criu check` passes (rollout/planner/criu_check.py says why not); the tests run it
there and are skipped elsewhere.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from rollout.errors import Issue, RolloutError
from rollout.executor.ownership import Owner
from rollout.executor.processes import marked_processes, proc_stat
from rollout.planner.criu_check import CRIU, criu_problem
from rollout.storage.base import RunRecord

DUMP_FLAGS = ("--tcp-established", "--file-locks", "--ext-unix-sk")
DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"
TIMEOUT_S = 600


def dump_run(run: RunRecord, directory: Path) -> int:
    """Dump run `run`'s process tree into `directory`, leaving it running; its root's pid."""
    _require_criu()
    root = tree_root(run)
    directory.mkdir(parents=True, exist_ok=True)
    command = [
        CRIU,
        "dump",
        "--tree",
        str(root),
        "--images-dir",
        str(directory),
        "--leave-running",
        *DUMP_FLAGS,
        "--log-file",
        DUMP_LOG,
        "-v4",
    ]
    _run(command, directory / DUMP_LOG, what=f"dumping run {run.run_id}'s processes")
    return root


def restore_processes(directory: Path) -> int:
    """Restore the tree dumped into `directory`, wait for it to end; its root's exit status."""
    _require_criu()
    command = [
        CRIU,
        "restore",
        "--images-dir",
        str(directory),
        *DUMP_FLAGS,
        "--log-file",
        RESTORE_LOG,
        "-v4",
    ]
    return _run(command, directory / RESTORE_LOG, what="restoring processes", check=False)


def tree_root(run: RunRecord) -> int:
    """The pid of the run's torchrun on this host; a RolloutError when it has none here."""
    owner = Owner.from_json(run.owner)
    if run.status != "running" or owner is None:
        raise RolloutError(Issue("run id", f"run {run.run_id!r} has no live processes to dump"))
    if owner.host != socket.gethostname():
        raise RolloutError(
            Issue(
                "run id",
                f"run {run.run_id!r} runs on {owner.host}: CRIU dumps processes of this host only",
                hint="run `rollout snapshot save` on that host",
            )
        )
    marked = set(marked_processes(owner.token))
    roots = [pid for pid in marked if _parent(pid) not in marked]
    if len(roots) != 1:
        raise RolloutError(
            Issue(
                "run id",
                f"run {run.run_id!r}: expected one torchrun at the root of its processes, "
                f"found {len(roots)} ({sorted(roots)})",
            )
        )
    return roots[0]


def _parent(pid: int) -> int | None:
    fields = proc_stat(pid)
    return int(fields[1]) if fields else None


def _require_criu() -> None:
    problem = criu_problem()
    if problem is not None:
        raise RolloutError(
            Issue(
                "snapshot.process",
                f"process snapshots need a usable CRIU, and {problem}",
                hint="snapshot on a host where `criu check` passes, or plan with "
                "snapshot.process = false",
            )
        )


def _run(command: list[str], log: Path, *, what: str, check: bool = True) -> int:
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    if check and done.returncode != 0:
        raise RolloutError(
            Issue(
                "snapshot.process",
                f"{what} failed (criu exit {done.returncode}): "
                f"{(done.stderr or done.stdout).strip()[-300:] or 'no output'}",
                hint=f"CRIU's log: {log}",
            )
        )
    return done.returncode
