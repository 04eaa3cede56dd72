"""EngineService's counterpart for an engine that only has the Protocol's generate (an engine
plugin): the same thread-safe submit/submit_many/close, over whole generate calls.

The hf engine's EngineService steps a decode batch that requests join at any step, and streams
tokens as they are sampled. An engine plugin is a black box that takes a batch of prompts and
returns their completions, so here one background thread takes every request that arrived,
groups those with equal SamplingParams into one generate call each, and hands each request its
completions when the call returns: a stream then carries each sample's text in one event, at its
end. Requests that arrive during a call wait for the next one; a cancelled request is skipped if
its call has not started.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from rollout.engines.base import Engine, SamplingParams
from rollout.engines.service import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_REQUESTS,
    QueuedService,
    RequestHandle,
)

log = logging.getLogger("rollout.engines.batch_service")


class BatchService(QueuedService):
    """Runs an engine's generate in a background thread for concurrent callers; the service owns
    the engine while it runs."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        *,
        max_batch_size: int | None = None,
        max_requests: int = DEFAULT_MAX_REQUESTS,
    ) -> None:
        super().__init__(
            engine,
            partial(tokenizer.decode, skip_special_tokens=True),
            max_width=max_batch_size or DEFAULT_MAX_BATCH_SIZE,
            max_requests=max_requests,
        )

    @property
    def engine(self) -> Engine:
        return self._engine

    def _prepare(self, handle: RequestHandle) -> None:
        if not handle.prompt_ids:
            raise ValueError("a prompt has no tokens: every prompt needs at least one")

    # --- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._inbox and not self._closing:
                    self._lock.wait()
                arrived, self._inbox = self._inbox, []
                if not arrived:
                    break  # closing, and nothing left to do
            groups: dict[SamplingParams, list[RequestHandle]] = {}
            for handle in arrived:
                if not handle.cancelled:
                    groups.setdefault(handle.params, []).append(handle)
            for params, handles in groups.items():
                per_call = max(1, self._max_width // params.n)  # prompts, n completions each
                for start in range(0, len(handles), per_call):
                    self._call(params, handles[start : start + per_call])
            with self._lock:
                self._in_flight -= len(arrived)

    def _call(self, params: SamplingParams, handles: list[RequestHandle]) -> None:
        """One generate call for requests of equal parameters; a failing call fails them only."""
        handles = [handle for handle in handles if not handle.cancelled]
        if not handles:
            return
        self._live_rows = len(handles) * params.n
        try:
            completions = self._engine.generate([h.prompt_ids for h in handles], params)
            by_prompt: dict[int, list[Any]] = {}
            for completion in completions:
                by_prompt.setdefault(completion.prompt_index, []).append(completion)
            for index, handle in enumerate(handles):
                mine = by_prompt.get(index, [])
                if len(mine) != params.n:
                    raise RuntimeError(
                        f"the engine returned {len(mine)} completions for prompt {index}, "
                        f"asked for n={params.n}"
                    )
                if not handle.cancelled:
                    for sample, completion in enumerate(mine):
                        handle._finish(sample, completion)
        except Exception as error:
            log.exception("an engine call failed; failing its requests")
            for handle in handles:
                if not handle.done:
                    handle._fail(error)
        finally:
            self._live_rows = 0
