"""The process sandboxes (Python code, allow-listed shell) against real hostile code: each run
is a real subprocess; what the host cannot enforce is skipped with the probe's reason."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from rollout.harness.sandbox import (
    Limits,
    PythonSandbox,
    Refused,
    ShellSandbox,
    probe_sandbox,
)

FAST = Limits(cpu_s=2, memory_bytes=256 * 2**20, processes=16, wall_s=5.0, output_bytes=4096)


@pytest.fixture(scope="module")
def report():
    return probe_sandbox()


def _needs(report, capability: str) -> None:
    if not report.works(capability):
        detail = next(c.detail for c in report.capabilities if c.name == capability)
        pytest.skip(f"this host lacks {capability}: {detail}")


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    path = tmp_path / "episode"
    path.mkdir()
    return path


@pytest.fixture
def sandbox(workdir: Path, report) -> PythonSandbox:
    return PythonSandbox(workdir, FAST, require_network_isolation=report.works("network isolation"))


def _processes_in(directory: Path) -> list[int]:
    """Live processes whose working directory is the sandbox's: what a run left behind."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "cwd") == str(directory.resolve()):
                state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
                if state not in ("Z", "X"):
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_the_probe_prints_one_line_per_capability(report):
    lines = report.lines()
    assert len(lines) == len(report.capabilities) >= 5
    assert all("\n" not in line for line in lines)
    assert str(report).count("\n") == len(lines) - 1


def test_normal_code_runs_and_returns_its_output(sandbox, workdir):
    result = sandbox.run("import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)\n")
    assert result.ok, result
    assert result.stdout == "42\n" and result.stderr == "warn\n"
    assert sandbox.run("open('notes.txt', 'w').write('kept')").ok
    assert (workdir / "notes.txt").read_text() == "kept"


def test_an_exception_or_exit_code_is_the_codes_own_end(sandbox):
    raised = sandbox.run("raise ValueError('bad input')")
    assert raised.exit_code == 1 and raised.failure is None
    assert "ValueError: bad input" in raised.stderr
    assert sandbox.run("raise SystemExit(3)").exit_code == 3


def test_an_endless_loop_is_stopped_by_the_cpu_limit(workdir):
    sandbox = PythonSandbox(workdir, Limits(cpu_s=1, wall_s=5), require_network_isolation=False)
    result = sandbox.run("while True:\n    pass\n")
    assert result.failure is not None and result.failure.startswith("cpu"), result
    assert result.wall_s < 5


def test_sleeping_forever_is_stopped_by_the_wall_clock(workdir, report):
    limits = Limits(wall_s=0.5)
    sandbox = PythonSandbox(workdir, limits, require_network_isolation=False)
    result = sandbox.run("import time\ntime.sleep(60)")
    assert result.failure is not None and result.failure.startswith("timeout"), result
    assert result.exit_code is None and result.wall_s < 3


def test_unbounded_allocation_is_reported_as_memory(sandbox, report):
    _needs(report, "memory")
    result = sandbox.run("blocks = []\nwhile True:\n    blocks.append(bytearray(2**24))\n")
    assert result.failure is not None and result.failure.startswith("memory"), result


def test_flooding_stdout_is_truncated_and_reported(sandbox):
    result = sandbox.run("while True:\n    print('x' * 1000)\n")
    assert result.failure is not None and result.failure.startswith("output"), result
    assert 0 < len(result.stdout) <= FAST.output_bytes


def test_a_fork_bomb_is_bounded_reported_and_leaves_nothing(sandbox, workdir, report):
    _needs(report, "process limit")
    started = time.monotonic()
    result = sandbox.run("import os, time\nwhile True:\n    os.fork()\n    time.sleep(0.001)\n")
    assert result.failure is not None, result
    assert time.monotonic() - started < FAST.wall_s + 2
    assert _processes_in(workdir) == []


def test_nothing_the_code_forks_outlives_the_call(sandbox, workdir):
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    result = sandbox.run(code)
    assert result.ok and result.stdout == "parent done\n", result
    assert _processes_in(workdir) == []


def test_a_child_that_leaves_the_process_group_dies_too(sandbox, workdir, report):
    _needs(report, "process cleanup")
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
    )
    assert sandbox.run(code).failure is None
    assert _processes_in(workdir) == []


def test_writing_outside_the_directory_fails(sandbox, tmp_path, report):
    _needs(report, "file confinement")
    outside = tmp_path / "outside.txt"
    result = sandbox.run(f"open({str(outside)!r}, 'w').write('escaped')")
    assert result.exit_code == 1 and "Read-only file system" in result.stderr, result
    assert not outside.exists()
    escaped = sandbox.run("open('../escaped.txt', 'w').write('x')")
    assert escaped.exit_code == 1 and not (tmp_path / "escaped.txt").exists()


def test_a_socket_cannot_reach_a_listener_on_this_host(sandbox, report):
    _needs(report, "network isolation")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        result = sandbox.run(code)
    assert result.exit_code == 1 and "OSError" in result.stderr, result
    assert "net" in result.isolation


def test_a_huge_file_stops_at_the_file_size_limit(workdir, report):
    limits = Limits(file_bytes=2**16, wall_s=5)
    sandbox = PythonSandbox(workdir, limits, require_network_isolation=False)
    result = sandbox.run("open('big', 'wb').write(b'x' * 2**20)")
    assert result.exit_code != 0, result
    assert (workdir / "big").stat().st_size <= 2**16


def test_the_shell_runs_an_allowed_program_in_the_directory(workdir, report):
    (workdir / "a.txt").write_text("hello\n")
    shell = ShellSandbox(workdir, ["ls", "cat"], FAST, require_network_isolation=False)
    listed = shell.run("ls -1")
    assert listed.ok and listed.stdout.split() == ["a.txt"], listed
    assert shell.run(["cat", "a.txt"]).stdout == "hello\n"


@pytest.mark.parametrize(
    "command",
    ["rm -rf .", "sh -c 'ls'", "/bin/ls", "./ls", "ls; rm a.txt", "", "cat 'unclosed"],
)
def test_the_shell_refuses_what_is_not_allowed(workdir, command):
    shell = ShellSandbox(workdir, ["ls", "cat"], FAST, require_network_isolation=False)
    if command == "ls; rm a.txt":  # no shell: ';' is an argument, and 'ls;' is no program
        with pytest.raises(Refused, match="not allowed"):
            shell.run(command)
        return
    with pytest.raises(Refused):
        shell.run(command)


def test_misuse_raises_and_bad_limits_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        PythonSandbox(tmp_path / "missing", require_network_isolation=False).run("pass")
    with pytest.raises(ValueError, match="processes"):
        Limits(processes=0)
    with pytest.raises(ValueError, match="bare names"):
        ShellSandbox(tmp_path, ["/bin/sh"])


def test_a_program_that_fails_at_once_is_reported_at_once_every_time(workdir):
    # The launcher may end before its streams are read to their end; the run must then still
    # read them out, not wait for the wall clock (it did, about once in 30 runs).
    sandbox = PythonSandbox(workdir, FAST, require_network_isolation=False)
    for _ in range(40):
        result = sandbox.run("raise ValueError('no')")
        assert result.exit_code == 1 and "ValueError: no" in result.stderr, result
        assert result.failure is None and result.wall_s < FAST.wall_s
