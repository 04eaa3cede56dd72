"""The terminal view of a running plan, fed from the run store: a progress bar on a terminal,
one plain line per step otherwise (a log file, CI), nothing but the outcome without the
console tracker; then a summary table."""

from __future__ import annotations

import os
from typing import TextIO

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from rollout.executor.launch import Progress as RunProgress
from rollout.planner.definition import Plan
from rollout.storage.base import MetricRecord, RunRecord, RunStore

# Online runs show their reward, offline runs (DPO, SFT, reward models, ...) their loss and, where
# they have one, held-out accuracy; whichever the run writes.
SHOWN = (
    "reward/mean",
    "train/loss",
    "eval/reward",
    "eval/accuracy",
    "eval/loss",
    "perf/tokens_per_s",
    "perf/step_s",
)
_LABELS = {
    "reward/mean": "reward",
    "train/loss": "loss",
    "eval/reward": "eval",
    "eval/accuracy": "eval acc",
    "eval/loss": "eval loss",
    "perf/tokens_per_s": "tok/s",
    "perf/step_s": "s/step",
}
SUMMARIZED = (
    "reward/",
    "eval/",
    "train/loss",
    "train/kl",
    "train/accuracy",
    "train/margin",
    "perf/step_s",
    "perf/tokens_per_s",
    "completion/tokens_mean",
)


class RunView:
    """The executor's progress callbacks (`callbacks`), drawing on `console`."""

    def __init__(self, console: Console, *consoles: Console):
        self.console = console
        self._all = (console, *consoles)
        self.shows_progress = True
        self._bar: Progress | None = None
        self._task = None
        self._last_step = 0
        self._devnull: TextIO | None = None
        self.callbacks = RunProgress(
            on_start=self.on_start,
            on_poll=self.on_poll,
            on_signal=self.on_signal,
            on_already_finished=self.on_already_finished,
            on_restart=self.on_restart,
            on_metrics=self.on_metrics,
        )

    def on_metrics(self, url: str) -> None:
        self.console.print(f"metrics: {escape(url)}")

    def on_start(self, plan: Plan, resumed: bool) -> None:
        self.shows_progress = "console" in plan.config.logging.trackers
        verb = "resuming" if resumed else "starting"
        self.console.print(
            f"{verb} [bold]{escape(plan.run_id)}[/]: {plan.config.algorithm.kind}, "
            f"{plan.derived.total_steps} steps, run dir {escape(plan.derived.run_dir)}"
        )
        if self.shows_progress and self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]step {task.completed:.0f}/{task.total:.0f}"),
                BarColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._bar.add_task(
                "run", total=plan.derived.total_steps, stats="starting workers..."
            )
            self._bar.start()

    def on_poll(self, plan: Plan, store: RunStore) -> None:
        if not self.shows_progress:
            return
        latest = store.latest_metrics(plan.run_id)
        if not latest:
            return
        step = max(record.step for record in latest.values())
        stats = "  ".join(_format(name, latest[name].value) for name in SHOWN if name in latest)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, stats=stats)
        elif step > self._last_step:
            # Not a terminal: a bar would be redrawn into the file as cut-off lines.
            self.console.print(f"step {step}/{plan.derived.total_steps}  {stats}", crop=False)
        self._last_step = max(self._last_step, step)

    def on_signal(self, name: str) -> None:
        if name == "SIGHUP":
            # The terminal is gone: writing to it would fail. The run stops and is recorded.
            self._devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the consoles
            for console in self._all:
                console.file = self._devnull
            self._bar = None

    def on_restart(self, line: str) -> None:
        self.console.print(f"[yellow]restarting[/]: {escape(line)}", crop=False)

    def on_already_finished(self, plan: Plan, record: RunRecord) -> None:
        self.console.print(
            f"{escape(plan.run_id)} already finished (step {record.last_step}): nothing to run"
        )

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _format(name: str, value: float) -> str:
    return f"{_LABELS[name]} {value:.3g}"


def summary(record: RunRecord, store: RunStore) -> Table | None:
    """First and last value of the metrics worth a glance; None when the run wrote none."""
    series: dict[str, list[MetricRecord]] = {}
    for row in store.metrics(record.run_id):
        if row.name.startswith(SUMMARIZED):
            series.setdefault(row.name, []).append(row)
    if not series:
        return None
    table = Table(title=f"{record.run_id}: {record.status}", title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("first", justify="right")
    table.add_column("last", justify="right")
    table.add_column("steps", justify="right")
    for name in sorted(series):
        values = [row.value for row in series[name]]
        table.add_row(escape(name), f"{values[0]:.4g}", f"{values[-1]:.4g}", str(len(values)))
    return table
