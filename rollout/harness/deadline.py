"""Call plugin code under a time limit, on a thread of its own.

Python cannot kill a thread: a call that overruns keeps its thread, and the caller stops waiting
and reports it (rewards stop the step; environments fail the episode or stop the step). The
thread is a daemon rather than a ThreadPoolExecutor worker, which interpreter exit would join, so
a hung plugin cannot also keep a stopped process alive.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any


class Overran(Exception):
    """The call did not return within its limit (it may still be running on its thread)."""


class Raised(Exception):
    """The call raised `error` (anything, SystemExit included): kept apart from what interrupts
    the waiting thread itself (a KeyboardInterrupt there is not the plugin's doing)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def call_with_deadline(fn: Callable[[], Any], timeout_s: float, *, name: str) -> Any:
    """fn() on a daemon thread named `name`: its result; Raised wrapping what it raised;
    Overran when it takes longer than `timeout_s`."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def work() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # whatever happens, the waiting side hears of it
            future.set_exception(exc)

    threading.Thread(target=work, name=name, daemon=True).start()
    done, _ = concurrent.futures.wait([future], timeout=timeout_s)
    if not done:
        raise Overran(name)
    error = future.exception()
    if error is not None:
        raise Raised(error) from error
    return future.result()
