"""What the sandbox can enforce on this host, found by trying it, and what it falls back to.

The planner calls probe_sandbox() before a run that executes model-written code: a capability
marked not working is either refused by the plan or accepted by an explicit opt-out in the config.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rollout.harness.sandbox.process import Limits, SandboxUnavailable, run_limited


@dataclass(frozen=True)
class Capability:
    name: str
    works: bool
    detail: str  # how it is enforced, or what happens instead

    def line(self) -> str:
        return f"{self.name:<18} {'yes' if self.works else 'NO ':<4}{self.detail}"


@dataclass(frozen=True)
class SandboxReport:
    capabilities: tuple[Capability, ...]

    def works(self, name: str) -> bool:
        return any(c.name == name and c.works for c in self.capabilities)

    def lines(self) -> list[str]:
        return [capability.line() for capability in self.capabilities]

    def __str__(self) -> str:
        return "\n".join(self.lines())


_CONNECT = """
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
    print("connected")
except OSError:
    print("refused")
"""
_WRITE_OUTSIDE = """
try:
    open({path!r}, "w").write("x")
    print("written")
except OSError:
    print("refused")
"""
_FORK = """
import os, time
made = 0
try:
    for _ in range(16):
        if os.fork() == 0:
            time.sleep(2)
            os._exit(0)
        made += 1
except OSError:
    pass
print(made)
"""
_ALLOCATE = """
try:
    block = bytearray(256 * 2**20)
    print("allocated")
except MemoryError:
    print("refused")
"""


def probe_sandbox() -> SandboxReport:
    """Try each capability in a real sandboxed run (well under a second in all)."""
    with tempfile.TemporaryDirectory(prefix="rollout-probe-") as scratch:
        root = Path(scratch)
        workdir, outside = root / "work", root / "outside.txt"
        workdir.mkdir()
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            port = listener.getsockname()[1]
            network = _run(workdir, _CONNECT.format(port=port), require_network=True)
        writes = _run(workdir, _WRITE_OUTSIDE.format(path=str(outside)), require_network=False)
        forks = _run(workdir, _FORK, require_network=False, limits=Limits(processes=6))
        memory = _run(
            workdir, _ALLOCATE, require_network=False, limits=Limits(memory_bytes=128 * 2**20)
        )
    return SandboxReport(
        (
            _network(network),
            _pids(forks),
            _files(writes),
            _processes(forks),
            Capability(
                "memory",
                memory.stdout.strip() == "refused",
                "RLIMIT_AS per process"
                if memory.stdout.strip() == "refused"
                else "RLIMIT_AS not enforced: memory is bounded only by the host",
            ),
            Capability(
                "cpu and files", True, "RLIMIT_CPU, RLIMIT_FSIZE, wall-clock timeout, output cap"
            ),
        )
    )


@dataclass(frozen=True)
class _Outcome:
    stdout: str
    isolation: tuple[str, ...]
    error: str | None


def _run(workdir: Path, code: str, *, require_network: bool, limits: Limits = Limits()) -> _Outcome:
    try:
        result = run_limited(
            [sys.executable, "-I", "-S", "-B", "-c", code],
            workdir,
            limits,
            require_network_isolation=require_network,
        )
    except SandboxUnavailable as error:
        return _Outcome("", (), str(error))
    return _Outcome(result.stdout, result.isolation, None)


def _network(outcome: _Outcome) -> Capability:
    if outcome.error is None and outcome.stdout.strip() == "refused":
        return Capability("network isolation", True, "network namespace: no interface is reachable")
    reason = outcome.error or "a socket reached a listener on 127.0.0.1"
    return Capability(
        "network isolation",
        False,
        f"network is NOT isolated ({reason}); the plan must refuse to run model-written code, "
        "or the config must opt out explicitly",
    )


def _pids(outcome: _Outcome) -> Capability:
    if "pid" in outcome.isolation:
        return Capability("process cleanup", True, "pid namespace: all it starts dies with it")
    return Capability(
        "process cleanup",
        False,
        "no pid namespace: the process group is killed, but a process that leaves its group "
        "(setsid) can outlive the run",
    )


def _files(outcome: _Outcome) -> Capability:
    if outcome.stdout.strip() == "refused":
        return Capability(
            "file confinement", True, "mount namespace: all but the work dir read-only"
        )
    return Capability(
        "file confinement",
        False,
        "writes outside the work dir are NOT prevented (no mount namespace): only file "
        "permissions and RLIMIT_FSIZE apply; the file tools stay confined",
    )


def _processes(outcome: _Outcome) -> Capability:
    try:
        made = int(outcome.stdout.strip())
    except ValueError:
        made = -1
    if 0 <= made < 16:
        how = "pids cgroup (root ignores RLIMIT_NPROC)" if os.geteuid() == 0 else "RLIMIT_NPROC"
        return Capability("process limit", True, how)
    return Capability(
        "process limit",
        False,
        "not enforced (running as root without a writable pids cgroup, or RLIMIT_NPROC "
        "ignored): a fork bomb is bounded only by the CPU limit and wall-clock timeout",
    )
