"""Checkpoint uploads off the training loop's critical path: at most one in flight.

Saving to an object store stages the checkpoint locally (what a training step waits for), then
an upload thread commits it (parts, manifest last, retention, the run store's record) while the
next steps train. Starting the next upload, and ending the run, wait for the one in flight
first: two uploads never race on a root, and a run never ends with its last checkpoint half up.

A failed upload is logged at once (it reaches the run's logs while training goes on) and raised
where the loop next waits: its next checkpoint, or its end. The run then fails rather than train
on: its checkpoints are what it leaves behind, and a run that cannot write them would end
"finished" with nothing saved. What it loses is bounded by one checkpoint interval.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

log = logging.getLogger("rollout.checkpoint")


class Uploads:
    """One upload thread at a time; `wait` joins it and raises what it raised."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, what: str, upload: Callable[[], None]) -> None:
        """Run `upload` on a thread of its own, after the previous one ends (raising its error
        instead of starting, where it failed). `what` names it in the thread's name."""
        self.wait()

        def run() -> None:
            try:
                upload()
            except BaseException as error:  # kept for wait(), whatever it was
                log.error("%s failed: %s", what, error)
                self._error = error

        self._thread = threading.Thread(target=run, name=f"rollout-{what}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until no upload is in flight; raise the error of one that failed (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def wait_quietly(self) -> None:
        """`wait`, for a run that is failing already: an upload's error is logged (by the
        thread), never raised over the error that ends the run."""
        with contextlib.suppress(Exception):  # logged where it happened
            self.wait()
