"""Run one program under the sandbox's limits and isolation, and say how it ended.

The program runs through launcher.py (namespaces, rlimits, capabilities: see there) in its own
session, so one SIGKILL to the process group (and the pid namespace's end) takes everything it
started with it. Output is read as it comes, up to a cap per stream; a program that floods past
the cap is stopped, not buffered.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

LAUNCHER = Path(__file__).with_name("launcher.py")
PIDS_CGROUP_ROOT = Path("/sys/fs/cgroup/pids")
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
STRAGGLER_GRACE_S = 0.5
"""How long the streams may stay open after the launcher ended before what holds them is
killed."""


class SandboxUnavailable(RuntimeError):
    """The host cannot give the isolation the caller required (e.g. no network namespaces)."""


class Refused(Exception):
    """A request the sandbox will not carry out (a program not allowed, a path outside the
    directory, a host not on the egress list). The message says why; a tool returns it to the
    model as its observation."""


@dataclass(frozen=True)
class Limits:
    """What one run may use. cpu_s: CPU seconds (RLIMIT_CPU); memory_bytes: address space per
    process (RLIMIT_AS); processes: process count (RLIMIT_NPROC, or a pids cgroup as root);
    file_bytes: largest file it may write (RLIMIT_FSIZE); wall_s: wall-clock timeout;
    output_bytes: cap on each of stdout and stderr."""

    cpu_s: int = 5
    memory_bytes: int = 512 * 2**20
    processes: int = 32
    file_bytes: int = 16 * 2**20
    wall_s: float = 10.0
    output_bytes: int = 64 * 2**10

    def __post_init__(self) -> None:
        for name in ("cpu_s", "memory_bytes", "processes", "file_bytes", "output_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive integer, got {value!r}")
        if not self.wall_s > 0:
            raise ValueError(f"Limits.wall_s must be positive, got {self.wall_s!r}")


@dataclass(frozen=True)
class RunResult:
    """How a sandboxed program ended. failure: None when it ran to its own end (whatever its
    exit code), else why the sandbox stopped it or what limit it hit ("timeout: ...", "cpu: ...",
    "memory: ...", "output: ...", "signal: ..."). exit_code: negative for a signal, None when
    the sandbox killed it. isolation: the namespaces that took effect ("net", "pid", "mount")."""

    stdout: str
    stderr: str
    exit_code: int | None
    failure: str | None
    cpu_s: float
    wall_s: float
    isolation: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.failure is None and self.exit_code == 0


def run_limited(
    argv: list[str],
    workdir: Path,
    limits: Limits,
    *,
    require_network_isolation: bool = True,
    python_errors: bool = False,
) -> RunResult:
    """Run argv with cwd workdir under limits; never raises for what the program does.

    python_errors: read a Python traceback's last line to name memory and process-limit
    failures (the interpreter turns those limits into MemoryError and BlockingIOError).
    Raises SandboxUnavailable when network isolation is required and this host cannot give it.
    """
    workdir = Path(workdir).resolve()
    if not workdir.is_dir():
        raise ValueError(f"the sandbox directory {workdir} does not exist")
    read_status, write_status = os.pipe()
    spec = {
        "argv": list(argv),
        "cwd": str(workdir),
        "env": {"PATH": SAFE_PATH, "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8"},
        "limits": {
            "cpu_s": limits.cpu_s,
            "memory_bytes": limits.memory_bytes,
            "processes": limits.processes,
            "file_bytes": limits.file_bytes,
        },
        "require_network_isolation": require_network_isolation,
        "status_fd": write_status,
        "pids_cgroup": None,
    }
    started = time.monotonic()
    process = _start(spec, read_status, write_status)
    try:
        stdout, stderr, stopped = _collect(process, limits, started)
    finally:
        _kill_group(process)
        cgroup = spec["pids_cgroup"]
        if cgroup:
            _remove_cgroup(Path(cgroup))
    wall_s = time.monotonic() - started
    status = _read_status(read_status)
    if "error" in status:
        raise SandboxUnavailable(status["error"])
    out, err = (_text(data, limits.output_bytes) for data in (stdout, stderr))
    exit_code = None
    if "exit" in status:
        exit_code = status["exit"]
    elif "signal" in status:
        exit_code = -status["signal"]
    failure = stopped or _failure(status, limits, err if python_errors else "")
    return RunResult(
        stdout=out,
        stderr=err,
        exit_code=None if stopped else exit_code,
        failure=failure,
        cpu_s=float(status.get("cpu_s", 0.0)),
        wall_s=wall_s,
        isolation=tuple(status.get("namespaces", ())),
    )


def _start(spec: dict, read_status: int, write_status: int) -> subprocess.Popen:
    if os.geteuid() == 0 and (PIDS_CGROUP_ROOT / "cgroup.procs").exists():
        # named now, created by the launcher once it knows its pid; removed by us afterwards
        spec["pids_cgroup"] = str(
            PIDS_CGROUP_ROOT / f"rollout-sandbox-{os.getpid()}-{time.time_ns()}"
        )
    try:
        return subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", str(LAUNCHER), json.dumps(spec)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(write_status,),
            env={"PATH": SAFE_PATH},
            start_new_session=True,  # its own process group: killed as one
        )
    finally:
        os.close(write_status)


def _collect(
    process: subprocess.Popen, limits: Limits, started: float
) -> tuple[bytes, bytes, str | None]:
    """Read both streams until they close and the launcher ends, the wall clock runs out, or a
    stream passes its cap; the reason the sandbox stopped it, or None."""
    buffers = {process.stdout: bytearray(), process.stderr: bytearray()}
    names = {process.stdout: "stdout", process.stderr: "stderr"}
    deadline = started + limits.wall_s
    exited_at: float | None = None
    with selectors.DefaultSelector() as selector:
        for stream in buffers:
            selector.register(stream, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return (
                    bytes(buffers[process.stdout]),
                    bytes(buffers[process.stderr]),
                    (f"timeout: still running after {limits.wall_s:g} s of wall-clock time"),
                )
            if not selector.get_map() and _exited(process):
                break
            if not selector.get_map():  # streams closed, the launcher not yet gone
                time.sleep(min(remaining, 0.01))
                continue
            for key, _ in selector.select(timeout=min(remaining, 0.1)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = buffers[key.fileobj]
                buffer += chunk
                if len(buffer) > limits.output_bytes:
                    return (
                        bytes(buffers[process.stdout]),
                        bytes(buffers[process.stderr]),
                        (
                            f"output: {names[key.fileobj]} passed {limits.output_bytes} bytes; "
                            "truncated and the program stopped"
                        ),
                    )
            if _exited(process) and selector.get_map():
                # The launcher is gone: the streams' last bytes and their ends come a moment
                # later (this loop may see the exit first). A straggler still holding a stream
                # after that (no pid namespace) is killed, and reading stops: killing closes
                # the streams, which a selector would then wait on until the deadline.
                exited_at = exited_at if exited_at is not None else time.monotonic()
                if time.monotonic() - exited_at > STRAGGLER_GRACE_S:
                    for key in list(selector.get_map().values()):
                        selector.unregister(key.fileobj)
                    _kill_group(process)
                    break
    return bytes(buffers[process.stdout]), bytes(buffers[process.stderr]), None


def _exited(process: subprocess.Popen) -> bool:
    """Whether the launcher ended, without reaping it: its pid stays ours until the group is
    killed, so the group id cannot be reused under us."""
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(process: subprocess.Popen) -> None:
    if process.returncode is None:  # once reaped, its group id may belong to someone else
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def _remove_cgroup(path: Path) -> None:
    """Kill whatever is still in the run's cgroup (a process that left the group), then remove
    it; the kernel refuses rmdir until it is empty."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            pids = (path / "cgroup.procs").read_text().split()
        except OSError:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.01)


def _read_status(fd: int) -> dict:
    chunks = []
    with contextlib.suppress(OSError):
        os.set_blocking(fd, False)
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    os.close(fd)
    lines = b"".join(chunks).decode(errors="replace").splitlines()
    try:
        return json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        return {}


def _text(data: bytes, cap: int) -> str:
    return data[:cap].decode(errors="replace")


def _failure(status: dict, limits: Limits, stderr: str) -> str | None:
    cpu_s = float(status.get("cpu_s", 0.0))
    sig = status.get("signal")
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= limits.cpu_s - 0.05):
        return f"cpu: used {cpu_s:.1f} s of CPU time (limit {limits.cpu_s} s)"
    if sig == signal.SIGXFSZ:
        return f"file size: wrote past {limits.file_bytes} bytes"
    if sig is not None:
        return f"signal: killed by {_signal_name(sig)}"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if lines and lines[-1].startswith("MemoryError"):
        return f"memory: ran out of its {limits.memory_bytes} bytes of address space"
    # Every process of a fork bomb writes its traceback to the one stderr, interleaved: the
    # limit's error is some line, not always the last.
    if any(
        line.startswith("BlockingIOError") and "Resource temporarily unavailable" in line
        for line in lines
    ):
        return f"processes: reached the limit of {limits.processes} processes"
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
