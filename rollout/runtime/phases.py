"""Seconds per phase of a training step, right on a GPU too, and what the CUDA allocator did.

On a GPU, kernels run after the Python that queued them has moved on: a phase timed on the host
alone is charged with whatever earlier phases left queued, and a phase that only queues work
looks free. PhaseClock waits for the device at each phase edge, so each phase is charged with
its own kernels. The edges are where the loop reads results anyway (generation hands back token
lists, the learner reads its metrics once per update), so the waits cost next to nothing.

Per step on CUDA it also reports the peak memory allocated and how often the caching allocator
had to free its cache and retry an allocation (`num_alloc_retries`): a retry synchronizes the
device and returns every cached block to the driver, and the allocations after it start from
nothing; a step with retries is a slow step.

Each phase is also a span (rollout.tracing) of its name: log lines written in it carry it
(`rollout logs tail --span learn`), and with [logging] otlp_endpoint it is exported as a trace.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

from rollout.tracing import span


class PhaseClock:
    """Times named phases of one step on `device`; `metrics()` gives perf/<phase>_s."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.seconds: dict[str, float] = defaultdict(float)
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._retries = 0
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._retries = _alloc_retries(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._wait()
        started = time.perf_counter()
        try:
            with span(name):
                yield
                self._wait()  # the phase's kernels end inside its span
        finally:
            self.seconds[name] += time.perf_counter() - started

    def metrics(self) -> dict[str, float]:
        metrics = {f"perf/{name}_s": value for name, value in self.seconds.items()}
        if self._cuda:
            metrics["perf/cuda_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            metrics["perf/cuda_alloc_retries"] = float(_alloc_retries(self.device) - self._retries)
        return metrics

    def _wait(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)


def _alloc_retries(device: torch.device) -> int:
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
