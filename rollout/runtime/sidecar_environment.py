"""An environment plugin served by a sidecar (rollout.plugins.sidecar), behind the Environment
Protocol: the worker's episode loop calls it like the in-process object.

An environment is state (its episodes), and a killed child takes that state with it. So a reset,
which starts every episode afresh, is resubmitted once to a restarted child like a reward's
batch; a step is not: a hung or crashed step fails (as environment.on_error says), and every
later step fails at once, saying why, until the next reset starts a fresh child's episodes.

A reset that hangs or crashes twice is bisected over its rows (rollout.harness.isolate) only to
name the row it fails on alone: a failing reset stops the step whatever the row. A step is
never bisected: the killed child took the state every half of it would need.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from rollout.harness.environments.base import Row, StepResult
from rollout.harness.isolate import isolate, isolation_budget_s
from rollout.plugins.sidecar.host import SidecarError, SidecarHost, SidecarPluginError


class SidecarEnvironment:
    """reset/step/close of the environment the sidecar built; each call has `timeout_s`."""

    enforces_deadline = True
    """The host kills a call past timeout_s: callers need no thread deadline of their own."""

    def __init__(self, host: SidecarHost, *, timeout_s: float):
        self.host = host
        self.timeout_s = timeout_s
        self._lost: str | None = None
        host.start()  # now, so a sidecar that cannot start stops the worker before step 1

    def reset(self, rows: Sequence[Row], *, seed: int) -> list[str]:
        self._lost = None
        plain = [dict(row) for row in rows]
        try:
            return self.host.call(
                [plain],
                {"seed": seed},
                method="reset",
                timeout_s=self.timeout_s,
                what=f"a reset of {len(rows)} episodes",
            )
        except SidecarPluginError:
            raise  # the plugin's own message and line say what it could not start
        except SidecarError as error:
            raise self._blame_a_row(plain, seed, error) from None

    def _blame_a_row(self, rows: list[dict[str, Any]], seed: int, error: SidecarError) -> Exception:
        """`error`, naming the first row the reset fails on alone, if bisection finds one."""
        n = len(rows)

        def attempt(indices: Sequence[int]) -> list[Any]:
            what = f"a reset of row {indices[0]} of {n}" if len(indices) == 1 else "a reset"
            return self.host.call(
                [[rows[i] for i in indices]],
                {"seed": seed},
                method="reset",
                timeout_s=self.timeout_s,
                what=what,
                retry=False,
            )

        found = isolate(
            n,
            attempt,
            first_cause=str(error),
            budget_s=isolation_budget_s(self.timeout_s, n),
            stop_at_first=True,
        )
        if not found.failed:  # every part started alone: no one row is to blame
            return error
        row = min(found.failed)
        blamed = SidecarError(
            f"sidecar for {self.host.name!r} failed on a reset of {n} episodes, and on row {row} "
            f"({_identify(rows[row])}) alone: {found.failed[row]}"
        )
        blamed.sample = row  # type: ignore[attr-defined]
        return blamed

    def step(self, episodes: Sequence[int], actions: Sequence[str]) -> list[Any]:
        if self._lost is not None:
            raise SidecarError(
                f"sidecar for {self.host.name!r} was stopped during an earlier step and its "
                f"episodes with it ({self._lost}); they go on after the next reset"
            )
        try:
            results = self.host.call(
                [list(episodes), list(actions)],
                method="step",
                timeout_s=self.timeout_s,
                what=f"a step of episodes {_span(episodes)}",
                retry=False,
            )
        except SidecarPluginError:
            raise  # the plugin raised; the child and its episodes are still there
        except SidecarError as error:
            self._lost = str(error).split(";", 1)[0]
            raise
        return [_step_result(item) for item in results] if isinstance(results, list) else results

    def close(self) -> None:
        """The environment's own close(), if it has one, then the sidecar's end."""
        if self.host.pid is not None:
            with contextlib.suppress(SidecarError):
                self.host.call(method="close", timeout_s=self.timeout_s, retry=False)
        self.host.close()


def _step_result(item: Any) -> Any:
    """A StepResult from its JSON form; anything else as it came (the runner says what is
    wrong with it)."""
    if not isinstance(item, dict):
        return item
    try:
        return StepResult(**item)
    except TypeError:
        return item


def _identify(row: dict[str, Any]) -> str:
    """Something a person can find the row by: its id, else the start of the row itself."""
    if row.get("id") is not None:
        return f"row id {row['id']!r}"
    text = repr(row)
    return text if len(text) <= 80 else text[:79] + "…"


def _span(episodes: Sequence[int]) -> str:
    listed = ", ".join(str(e) for e in list(episodes)[:8])
    return listed + (f", ... ({len(episodes)} in all)" if len(episodes) > 8 else "")
