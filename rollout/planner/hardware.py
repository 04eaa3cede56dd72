"""What this machine offers a run: CPU cores, memory and NVIDIA GPUs, probed without torch.

GPUs come from `nvidia-smi`, so planning never initializes CUDA; a machine where it is missing or
fails is planned as one without GPUs.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess

from rollout.planner.definition import GpuFacts, HardwareFacts

NVIDIA_SMI_QUERY = [
    "--query-gpu=index,name,memory.total,memory.free",
    "--format=csv,noheader,nounits",
]
NVIDIA_SMI_TIMEOUT_S = 10

_MIB = 1 << 20
_KIB = 1 << 10


CGROUP_MEMORY_MAX = "/sys/fs/cgroup/memory.max"


def probe_hardware() -> HardwareFacts:
    total, available = _memory()
    limit = _cgroup_limit(CGROUP_MEMORY_MAX)
    if limit is not None and limit < total:
        # In a container the kernel reports the host's RAM, but the OOM killer enforces this.
        total, available = limit, min(available, limit)
    return HardwareFacts(
        platform=platform.platform(terse=True),
        cpu_count=_cpu_count(),
        memory_bytes=total,
        memory_available_bytes=available,
        gpus=_gpus(),
    )


def parse_nvidia_smi(text: str) -> list[GpuFacts]:
    """GPUs from `nvidia-smi --query-gpu=index,name,memory.total,memory.free
    --format=csv,noheader,nounits`.

    Each line reads like "0, NVIDIA H100 80GB HBM3, 81559, 80103" (memory in MiB; a name may hold
    commas, so the numbers are read from the right). Raises ValueError on a line that does not.
    """
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        index, *name, total, free = (part.strip() for part in line.split(","))
        if not name:
            raise ValueError(f"unexpected nvidia-smi line: {line!r}")
        gpus.append(
            GpuFacts(
                index=int(index),
                name=", ".join(name),
                memory_bytes=int(total) * _MIB,
                memory_free_bytes=int(free) * _MIB,
            )
        )
    return gpus


def parse_meminfo(text: str) -> tuple[int, int]:
    """(total, available) bytes from /proc/meminfo. Kernels before 3.14 lack MemAvailable: MemFree."""
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields:
            values[name] = int(fields[0]) * _KIB
    return values["MemTotal"], values.get("MemAvailable", values["MemFree"])


def parse_cgroup_limit(text: str) -> int | None:
    """A cgroup v2 memory.max value: bytes, or None for "max" (no limit)."""
    value = text.strip()
    return None if value in ("", "max") else int(value)


def _cgroup_limit(path: str) -> int | None:
    try:
        with open(path) as handle:
            return parse_cgroup_limit(handle.read())
    except (OSError, ValueError):
        return None


def _cpu_count() -> int:
    # The cores this process may run on (taskset, cgroup cpusets), not all the machine has.
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no sched_getaffinity
        return os.cpu_count() or 1


def _memory() -> tuple[int, int]:
    try:
        with open("/proc/meminfo") as handle:
            return parse_meminfo(handle.read())
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        total = page * os.sysconf("SC_PHYS_PAGES")
        try:
            return total, page * os.sysconf("SC_AVPHYS_PAGES")
        except ValueError:  # macOS cannot say what is available
            return total, total


def _gpus() -> list[GpuFacts]:
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return []
    try:
        result = subprocess.run(
            [executable, *NVIDIA_SMI_QUERY],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=True,
        )
        return parse_nvidia_smi(result.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        # A broken driver, a hung query or output we cannot read: plan for no GPUs.
        return []
