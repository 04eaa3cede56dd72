"""The terminal view of a running plan: a progress bar fed from the run store, then a summary."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from rollout.executor.launch import Progress as RunProgress
from rollout.planner.definition import Plan
from rollout.storage.base import RunRecord, RunStore

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


def live_progress(console: Console) -> tuple[RunProgress, Progress]:
    """A rich progress bar and the executor callbacks that drive it."""
    bar = Progress(
        TextColumn("[bold]step {task.completed:.0f}/{task.total:.0f}"),
        BarColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
    task = bar.add_task("run", total=1, stats="starting workers...")

    def on_start(plan: Plan, resumed: bool) -> None:
        verb = "resuming" if resumed else "starting"
        console.print(
            f"{verb} [bold]{plan.run_id}[/]: {plan.config.algorithm.kind}, "
            f"{plan.derived.total_steps} steps, run dir {plan.derived.run_dir}"
        )
        bar.update(task, total=plan.derived.total_steps)
        bar.start()

    def on_poll(plan: Plan, store: RunStore) -> None:
        latest = store.latest_metrics(plan.run_id)
        if not latest:
            return
        step = max(record.step for record in latest.values())
        stats = "  ".join(_format(name, latest[name].value) for name in SHOWN if name in latest)
        bar.update(task, completed=step, stats=stats)

    return RunProgress(on_start=on_start, on_poll=on_poll), bar


def _format(name: str, value: float) -> str:
    return f"{_LABELS[name]} {value:.3g}"


def summary(record: RunRecord, store: RunStore) -> Table:
    table = Table(title=f"{record.run_id}: {record.status}", title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("first", justify="right")
    table.add_column("last", justify="right")
    table.add_column("steps", justify="right")
    series: dict[str, list[float]] = {}
    for row in store.metrics(record.run_id):
        series.setdefault(row.name, []).append(row.value)
    for name in sorted(series):
        if name.startswith(
            (
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
        ):
            values = series[name]
            table.add_row(name, f"{values[0]:.4g}", f"{values[-1]:.4g}", str(len(values)))
    return table
