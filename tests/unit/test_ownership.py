"""Run ownership on one machine: the directory lock, owners that are alive or dead, and the
settings read from the environment (lease, stop grace, debug)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rollout.errors import RolloutError
from rollout.executor import launch, ownership
from rollout.executor.ownership import Owner, directory_lock, lease_seconds


def test_a_second_holder_of_the_run_directory_is_refused_with_the_first(tmp_path):
    with (
        directory_lock(tmp_path / "run", "r1") as first,
        pytest.raises(RolloutError) as caught,
        directory_lock(tmp_path / "run", "r1"),
    ):
        pass
    message = str(caught.value)
    assert "run r1 is already running" in message and f"pid {first.pid} " in message
    with directory_lock(tmp_path / "run", "r1"):  # released: free again
        pass


def test_an_owner_is_dead_only_when_this_machine_can_tell():
    assert not Owner.this_process().is_dead()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    owner = Owner.this_process()
    started = ownership._start_ticks(child.pid)
    child.wait()
    gone = Owner(owner.host, owner.boot_id, child.pid, started, "t", 0.0)
    assert gone.is_dead()
    elsewhere = Owner("another-host", owner.boot_id, child.pid, started, "t", 0.0)
    assert not elsewhere.is_dead()  # its lease decides


@pytest.mark.parametrize(
    ("value", "expected"), [(None, 30.0), ("5", 5.0), ("0.1", 1.0), ("x", 30.0)]
)
def test_the_lease_length_comes_from_the_environment(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(ownership.LEASE_ENV, raising=False)
    else:
        monkeypatch.setenv(ownership.LEASE_ENV, value)
    assert lease_seconds() == expected


@pytest.mark.parametrize(("value", "expected"), [(None, 30.0), ("3", 3.0), ("x", 30.0)])
def test_the_stop_grace_comes_from_the_environment(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(launch.GRACE_ENV, raising=False)
    else:
        monkeypatch.setenv(launch.GRACE_ENV, value)
    assert launch.stop_grace_seconds() == expected


def test_rollout_debug_shows_a_bugs_traceback_where_it_happened(monkeypatch):
    from rollout.cli import app as cli

    def broken() -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(cli, "app", broken)
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(RuntimeError, match="boom"):
        cli.main()
