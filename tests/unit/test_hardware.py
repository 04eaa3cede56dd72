"""The hardware probe: its parsers on sample output, and the probe on this machine."""

from __future__ import annotations

import platform
import subprocess

import pytest

from rollout.planner import hardware
from rollout.planner.definition import GpuFacts

MIB = 1 << 20

# The probe reads platform.platform(), whose first call runs `uname -p` through subprocess.run:
# cache it now, or a test that patches subprocess.run (the one module object) breaks it when it
# happens to run first in the process.
platform.platform(terse=True)


def test_parse_nvidia_smi():
    text = "0, NVIDIA H100 80GB HBM3, 81559, 81000\n1, NVIDIA H100 80GB HBM3, 81559, 2048\n\n"
    assert hardware.parse_nvidia_smi(text) == [
        GpuFacts(
            index=0,
            name="NVIDIA H100 80GB HBM3",
            memory_bytes=81559 * MIB,
            memory_free_bytes=81000 * MIB,
        ),
        GpuFacts(
            index=1,
            name="NVIDIA H100 80GB HBM3",
            memory_bytes=81559 * MIB,
            memory_free_bytes=2048 * MIB,
        ),
    ]
    # A name with a comma keeps it: the numbers are read from the right.
    (gpu,) = hardware.parse_nvidia_smi("2, Odd, Name, 100, 40")
    assert (gpu.name, gpu.memory_bytes, gpu.memory_free_bytes) == ("Odd, Name", 100 * MIB, 40 * MIB)
    assert hardware.parse_nvidia_smi("") == []


@pytest.mark.parametrize(
    "text", ["0, NVIDIA A100, 40960, [N/A]", "No devices were found", "0, 40960, 100"]
)
def test_parse_nvidia_smi_rejects_other_output(text):
    with pytest.raises(ValueError):
        hardware.parse_nvidia_smi(text)


def test_parse_meminfo():
    text = "MemTotal:       16318504 kB\nMemFree:         1000000 kB\nMemAvailable:   12000000 kB\n"
    assert hardware.parse_meminfo(text) == (16318504 * 1024, 12000000 * 1024)
    # Kernels before 3.14 have no MemAvailable.
    old_kernel = "MemTotal: 2048 kB\nMemFree: 1024 kB\n"
    assert hardware.parse_meminfo(old_kernel) == (2048 * 1024, 1024 * 1024)


def test_probe_this_machine():
    facts = hardware.probe_hardware()
    assert facts.cpu_count >= 1
    assert 0 < facts.memory_available_bytes <= facts.memory_bytes
    assert facts.platform


def test_gpus_from_nvidia_smi(monkeypatch):
    calls = []

    def run(command, **kwargs):
        calls.append((command, kwargs["timeout"]))
        return subprocess.CompletedProcess(command, 0, stdout="3, Tesla T4, 15360, 15000\n")

    monkeypatch.setattr(hardware.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(hardware.subprocess, "run", run)
    gpus = hardware.probe_hardware().gpus
    assert gpus == [
        GpuFacts(index=3, name="Tesla T4", memory_bytes=15360 * MIB, memory_free_bytes=15000 * MIB)
    ]
    assert calls == [(["/usr/bin/nvidia-smi", *hardware.NVIDIA_SMI_QUERY], 10)]


@pytest.mark.parametrize(
    "failure",
    [
        subprocess.TimeoutExpired("nvidia-smi", 10),
        subprocess.CalledProcessError(9, "nvidia-smi"),
        PermissionError("denied"),
    ],
)
def test_any_nvidia_smi_failure_means_no_gpus(monkeypatch, failure):
    def run(command, **kwargs):
        raise failure

    monkeypatch.setattr(hardware.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(hardware.subprocess, "run", run)
    assert hardware.probe_hardware().gpus == []


def test_no_nvidia_smi_means_no_gpus(monkeypatch):
    monkeypatch.setattr(hardware.shutil, "which", lambda name: None)
    assert hardware.probe_hardware().gpus == []


def test_cgroup_limit_parsing():
    from rollout.planner.hardware import parse_cgroup_limit

    assert parse_cgroup_limit("max\n") is None
    assert parse_cgroup_limit("2147483648\n") == 2 * 1024**3


def test_a_container_limit_caps_memory(tmp_path, monkeypatch):
    from rollout.planner import hardware

    limit = tmp_path / "memory.max"
    limit.write_text("1073741824\n")
    monkeypatch.setattr(hardware, "CGROUP_MEMORY_MAX", str(limit))
    facts = hardware.probe_hardware()
    assert facts.memory_bytes == 1024**3
    assert facts.memory_available_bytes <= 1024**3
