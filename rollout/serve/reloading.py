"""`rollout serve --dev`: the served engine replaced between requests, for plugin development.

A ReloadableService stands where the server's service stands (same submit/submit_many/close, the
same counters for /metrics) and passes every call to the service it holds now. `swap` closes that
one, which answers the requests in flight in full, then starts the next: requests submitted while
it swaps wait for the new one (a dev server pauses for the swap; nothing is refused or lost).
What replaces the engine (re-importing the plugin's code, building it on the same model) is the
caller's: rollout.inference.serve_source builds it, the server's /admin/reload route calls it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from rollout.engines.base import SamplingParams


class ReloadableService:
    """A service (EngineService or BatchService) that can be swapped for another."""

    def __init__(self, service: Any) -> None:
        self._service = service
        self._swapping = threading.Lock()

    @property
    def current(self) -> Any:
        return self._service

    @property
    def engine(self) -> Any:
        return self._service.engine

    @property
    def stats(self) -> Any:
        return self._service.stats

    @property
    def closing(self) -> bool:
        return self._service.closing

    @property
    def occupancy(self) -> tuple[int, int]:
        return self._service.occupancy

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> Any:
        return self.submit_many([prompt_ids], [params])[0]

    def submit_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        *,
        notify: Callable[[], None] | None = None,
    ) -> list[Any]:
        with self._swapping:
            return self._service.submit_many(prompts, params, notify=notify)

    def swap(self, start: Callable[[], Any]) -> None:
        """Finish the requests in flight on the current service, close it and its engine, then
        serve with what `start()` returns."""
        with self._swapping:
            old = self._service
            old.close()
            old.engine.close()
            self._service = start()

    def close(self, timeout: float | None = None) -> None:
        self._service.close(timeout)
