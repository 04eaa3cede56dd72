"""No process of a run outlives it, on any exit path.

Three mechanisms, each covering what the one before cannot:

1. Parent-death signals. torchrun (started through `rollout.executor.torchrun`) and every worker
   ask the kernel for SIGKILL when their parent dies (prctl PR_SET_PDEATHSIG), so a host killed
   with SIGKILL takes torchrun with it, and torchrun its workers. torchrun starts each worker in a
   session of its own, so signalling torchrun's process group never reached them.
2. A marker in the environment. The host gives torchrun `ROLLOUT_RUN_TOKEN=<token>`, which every
   descendant inherits: a reward plugin's subprocesses, a daemon that double-forked or started a
   session of its own. `kill_marked` finds them in /proc whatever their parent or session.
3. A reaper. A small process outside the run's process tree and session holds the read end of a
   pipe whose write end only the host has. When the host ends, however it ends, the pipe closes
   and the reaper kills every marked process, then exits.

Linux only (prctl, /proc, environ); elsewhere the host still stops torchrun's process group.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

RUN_TOKEN_ENV = "ROLLOUT_RUN_TOKEN"
_PR_SET_PDEATHSIG = 1
_PROC = Path("/proc")


def die_with_parent(parent_pid: int) -> None:
    """Ask for SIGKILL when the parent dies; exit now if `parent_pid` is already gone.

    The check after the prctl closes the race where the parent died before we asked: we would
    then have been adopted by another process and never get the signal.
    """
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not fatal: the marker and the reaper still cover this process
    if os.getppid() != parent_pid:
        os._exit(1)


def new_token() -> str:
    return secrets.token_hex(16)


def marked_processes(token: str) -> list[int]:
    """Pids of every live process whose environment carries this run's token (never our own)."""
    if not _PROC.is_dir():
        return []
    needle = f"{RUN_TOKEN_ENV}={token}".encode()
    found = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            environ = (entry / "environ").read_bytes()
            if needle in environ.split(b"\0"):
                found.append(int(entry.name))
    return found


def kill_marked(token: str, *, timeout_s: float = 10.0) -> int:
    """SIGKILL every marked process until none is left (children may fork while we kill);
    return how many were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in marked_processes(token) if not _is_zombie(pid)]
        if not alive:
            break
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        time.sleep(0.05)
    return len(killed)


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None when there is
    no such process. The name is in parentheses and may hold spaces: split after its ')'."""
    try:
        return (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return None


def _is_zombie(pid: int) -> bool:
    """A killed child its parent has not reaped yet still has /proc/PID (and its environ)."""
    fields = proc_stat(pid)
    return fields is None or fields[0] in ("Z", "X")


class Reaper:
    """The process that kills what is left of the run once the host is gone."""

    def __init__(self, token: str):
        environment = {k: v for k, v in os.environ.items() if k != RUN_TOKEN_ENV}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "rollout.executor.reaper", token],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=environment,
            start_new_session=True,  # neither Ctrl-C nor a closed terminal reaches it
        )

    def close(self, timeout_s: float = 15.0) -> None:
        """Tell the reaper the host is done (as its death would) and wait for its last sweep."""
        assert self._process.stdin is not None
        with contextlib.suppress(OSError):
            self._process.stdin.close()
        try:
            self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def run_reaper(token: str) -> None:
    """The reaper's whole life: wait until the host's end of the pipe closes, then sweep."""
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        while sys.stdin.buffer.read(1 << 16):
            pass
    kill_marked(token)
