"""CapturedSteps: a step function captured in one CUDA graph per key, replayed after.

Why: a decode step of a small model is hundreds of small kernels, and launching them from Python
costs more than running them (20-30 ms a step on an H100 where the GPU needs 2-3). A graph
launches them all at once. The step must read and write tensors of fixed shape and address only
(StaticDecoder's buffers), and must not sync with the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

import torch


class CapturedSteps:
    """Graphs by key (a width bucket, a span bucket, a sampling variant), captured at the key's
    first run and sharing one memory pool: the graphs replay one at a time on one stream, and
    none returns a tensor, so each one's temporaries may reuse another's memory."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None
        self.captures = 0
        self.capture_seconds = 0.0

    def __len__(self) -> int:
        return len(self._graphs)

    def run(
        self,
        key: Hashable,
        step: Callable[[], None],
        *,
        save: Callable[[], Any],
        restore: Callable[[Any], None],
    ) -> None:
        """Run `step` through its graph, capturing it first if `key` is new. A capture runs the
        step once outside the graph first (libraries initialize lazily, which a capture cannot
        record): `save` before and `restore` after undo what that run changed."""
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(step, save, restore)
        graph.replay()

    def clear(self) -> None:
        """Drop every graph (what they read moved); the next runs capture again."""
        self._graphs.clear()

    def drop(self, which: Callable[[Any], bool]) -> None:
        """Drop the graphs whose key `which` accepts."""
        for key in [key for key in self._graphs if which(key)]:
            del self._graphs[key]

    def _capture(
        self, step: Callable[[], None], save: Callable[[], Any], restore: Callable[[Any], None]
    ) -> torch.cuda.CUDAGraph:
        started = time.perf_counter()
        current = torch.cuda.current_stream(self._device)
        saved = save()
        side = torch.cuda.Stream(self._device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            step()
        current.wait_stream(side)
        restore(saved)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine may capture in a service thread while others use CUDA.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            step()
        torch.cuda.synchronize(self._device)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - started
        return graph
