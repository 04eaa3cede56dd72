"""`rollout runs`: list, inspect and cancel the runs in a run store."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime
from enum import Enum
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from rollout.cli.options import Format, FormatOption
from rollout.cli.render import stdout, user_errors
from rollout.errors import Issue, RolloutError
from rollout.executor.ownership import reconcile
from rollout.storage import check_run_id, default_store_location, find_run, open_store
from rollout.storage.base import RUN_STATUSES, MetricRecord, RunRecord, RunStore

runs = typer.Typer(name="runs", help="List, inspect and cancel runs.", no_args_is_help=True)

StatusChoice = Enum("StatusChoice", {status: status for status in RUN_STATUSES}, type=str)

StoreOption = Annotated[
    str | None,
    typer.Option(
        "--store",
        metavar="LOCATION",
        help="Run store: sqlite:/path/to/rollout.db, or postgres:env:NAME (the variable holds "
        "the DSN). Default: $ROLLOUT_STORE, else sqlite:runs/rollout.db in the current directory.",
        show_default=False,
    ),
]
RunIdArgument = Annotated[
    str, typer.Argument(metavar="RUN_ID", help="A run id, as `rollout runs list` shows it.")
]

STATUS_STYLES = {
    "planned": "dim",
    "running": "cyan",
    "stopped": "yellow",
    "failed": "red",
    "finished": "green",
    "lost": "magenta",
}


@contextmanager
def reading(location: str | None) -> Iterator[tuple[RunStore, str]]:
    """The store at `location` (or the default) and its name; never creates one. Runs whose owner
    is gone are marked lost first, so no reader sees a dead run as running."""
    location = location or default_store_location()
    store = open_store(location, create=False)
    try:
        reconcile_quietly(store)
        yield store, location
    finally:
        store.close()


def reconcile_quietly(store: RunStore) -> None:
    """Best effort: a store this user may only read is still listed, as it stands."""
    with contextlib.suppress(Exception):
        reconcile(store)


@runs.command("list")
def list_(
    status: Annotated[
        StatusChoice | None, typer.Option("--status", help="Only runs in this status.")
    ] = None,
    store: StoreOption = None,
    fmt: FormatOption = Format.text,
) -> None:
    """The runs in the store, newest first."""
    with user_errors(fmt.value), reading(store) as (the_store, _):
        records = the_store.list_runs(status=status.value if status else None)
    if fmt is Format.json:
        stdout.print_json(json.dumps({"runs": [asdict(record) for record in records]}))
        return
    if not records:
        stdout.print("no runs" + (f" with status {status.value}" if status else ""))
        return
    stdout.print(_runs_table(records))


def _runs_table(records: list[RunRecord]) -> Table:
    table = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0))
    # The id starts with the run's name, so the name needs no column of its own. In a narrow
    # terminal only the error is shortened (with an ellipsis: `runs show` has the whole of it).
    id_width = max(len(record.run_id) for record in records)
    table.add_column("id", no_wrap=True, min_width=id_width)
    fixed = (("status", 8), ("started", 11), ("duration", 8), ("last step", 9))
    for column, width in fixed:
        table.add_column(column, no_wrap=True, min_width=width)
    # The error gets what the other columns leave: given more, rich would drop those instead.
    left = stdout.width - id_width - sum(width + 1 for _, width in fixed) - 1
    table.add_column("error", no_wrap=True, overflow="ellipsis", max_width=max(8, left))
    for record in records:
        table.add_row(
            escape(record.run_id),
            _status(record),
            _when(record.started_at, "%m-%d %H:%M"),
            _duration(record),
            "" if record.last_step is None else str(record.last_step),
            escape(_error_summary(record.error)),
        )
    return table


@runs.command()
def show(run_id: RunIdArgument, store: StoreOption = None, fmt: FormatOption = Format.text) -> None:
    """One run: status, times, paths, error, latest metrics, latest checkpoint."""
    with user_errors(fmt.value):
        check_run_id(run_id)
        with reading(store) as (the_store, location):
            record = find_run(the_store, run_id, location)
            metrics = the_store.latest_metrics(run_id)
            checkpoints = the_store.checkpoints(run_id)
    latest = checkpoints[-1] if checkpoints else None
    if fmt is Format.json:
        report: dict[str, Any] = asdict(record)
        report["metrics"] = {
            name: {"step": m.step, "value": m.value} for name, m in metrics.items()
        }
        report["checkpoint"] = asdict(latest) if latest else None
        stdout.print_json(json.dumps(report))
        return
    _print_run(record)
    if metrics:
        stdout.print(_metrics_table(metrics.values()))
    if latest:
        stdout.print(f"[bold]checkpoint[/]  step {latest.step}: {escape(latest.location)}")


def _print_run(record: RunRecord) -> None:
    fields = {
        "status": _status(record) + (" (cancel requested)" if record.cancel_requested else ""),
        "created": _when(record.created_at),
        "started": _when(record.started_at),
        "ended": _when(record.ended_at),
        "duration": _duration(record),
        "last step": "" if record.last_step is None else str(record.last_step),
        "plan": escape(record.plan_path),
        "run dir": escape(record.run_dir),
    }
    stdout.print(f"[bold]{escape(record.run_id)}[/] ({escape(record.name)})")
    for label, value in fields.items():
        stdout.print(f"  {label:<10} {value}")
    if record.error:
        stdout.print("[bold red]error[/]")
        stdout.print(escape(record.error.rstrip()))


def _metrics_table(metrics: Iterable[MetricRecord]) -> Table:
    table = Table(title="latest metrics", title_justify="left", box=None, pad_edge=False)
    table.add_column("metric", style="bold")
    table.add_column("step", justify="right")
    table.add_column("value", justify="right")
    for metric in metrics:
        table.add_row(escape(metric.name), str(metric.step), f"{metric.value:.6g}")
    return table


@runs.command()
def metrics(
    run_id: RunIdArgument,
    name: Annotated[
        str | None,
        typer.Option(
            "--name",
            help="Only metrics whose name starts with this (e.g. eval/ for `rollout eval`'s "
            "scores, eval/gsm8k/ for one suite).",
        ),
    ] = None,
    store: StoreOption = None,
    fmt: FormatOption = Format.text,
) -> None:
    """Every metric of a run over its steps: first, last, best and a trend line per metric."""
    with user_errors(fmt.value):
        check_run_id(run_id)
        with reading(store) as (the_store, location):
            find_run(the_store, run_id, location)
            rows = the_store.metrics(run_id)
    series: dict[str, list[MetricRecord]] = {}
    for row in rows:
        if name is None or row.name.startswith(name):
            series.setdefault(row.name, []).append(row)
    if fmt is Format.json:
        found = {key: [[r.step, r.value] for r in values] for key, values in series.items()}
        stdout.print_json(json.dumps({"run_id": run_id, "metrics": found}))
        return
    if not series:
        stdout.print(
            f"{escape(run_id)} has no metrics" + (f" named {escape(name)}*" if name else "")
        )
        return
    table = Table(title=f"{run_id}: metrics by step", title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("steps", justify="right")
    table.add_column("first", justify="right")
    table.add_column("last", justify="right")
    table.add_column("max", justify="right")
    table.add_column("trend")
    for key in sorted(series):
        values = [row.value for row in sorted(series[key], key=lambda row: row.step)]
        steps = series[key]
        table.add_row(
            escape(key),
            f"{steps[0].step}..{steps[-1].step}" if len(steps) > 1 else str(steps[0].step),
            f"{values[0]:.4g}",
            f"{values[-1]:.4g}",
            f"{max(values):.4g}",
            sparkline(values),
        )
    stdout.print(table)


@runs.command()
def compare(
    run_a: Annotated[str, typer.Argument(metavar="RUN_A", help="The run to compare against.")],
    run_b: Annotated[str, typer.Argument(metavar="RUN_B", help="The run compared with it.")],
    metric: Annotated[
        list[str] | None,
        typer.Option(
            "--metric",
            "-m",
            help="A metric to compare, or a prefix ending in / (eval/); repeatable. Default: "
            "every metric either run has.",
        ),
    ] = None,
    last: Annotated[
        int, typer.Option("--last", min=1, help="Steps the 'last N mean' column averages over.")
    ] = 10,
    store: StoreOption = None,
    fmt: FormatOption = Format.text,
) -> None:
    """Two runs' metrics side by side: last value, best, mean over the last N steps, and B's
    difference and ratio to A (on the last-N means)."""
    with user_errors(fmt.value):
        for run_id in (run_a, run_b):
            check_run_id(run_id)
        with reading(store) as (the_store, location):
            for run_id in (run_a, run_b):
                find_run(the_store, run_id, location)
            series = {run_id: _series(the_store.metrics(run_id)) for run_id in (run_a, run_b)}
        names = _chosen(sorted(set(series[run_a]) | set(series[run_b])), metric)
    rows = [
        compare_metric(name, series[run_a].get(name), series[run_b].get(name), last)
        for name in names
    ]
    if fmt is Format.json:
        stdout.print_json(
            json.dumps({"a": run_a, "b": run_b, "last": last, "metrics": rows}, allow_nan=False)
        )
        return
    if not rows:
        stdout.print(f"neither {escape(run_a)} nor {escape(run_b)} has metrics to compare")
        return
    table = Table(
        title=f"A = {run_a}   B = {run_b}", title_justify="left", box=None, pad_edge=False
    )
    table.add_column("metric", style="bold", no_wrap=True)
    for column in ("A last", "B last", "A best", "B best", "A avg", "B avg", "B−A", "B/A"):
        table.add_column(column, justify="right", no_wrap=True)
    for row in rows:
        a, b = row["a"] or {}, row["b"] or {}
        table.add_row(
            ("↓ " if row["better"] == "lower" else "") + escape(row["metric"]),
            _number(a.get("last")),
            _number(b.get("last")),
            _number(a.get("best")),
            _number(b.get("best")),
            _number(a.get("mean_last")),
            _number(b.get("mean_last")),
            _number(row["delta"]),
            _number(row["ratio"]),
        )
    stdout.print(table)
    stdout.print(
        f"[dim]avg: the mean of the last {last} recorded steps; B−A and B/A compare the avgs; "
        "best: the highest value, or the lowest for metrics marked ↓[/]"
    )


def _series(rows: Iterable[MetricRecord]) -> dict[str, list[float]]:
    """Each metric's finite values in step order (NaN is a diverged step, not a value)."""
    series: dict[str, list[float]] = {}
    for row in rows:  # ordered by name, then step
        if math.isfinite(row.value):
            series.setdefault(row.name, []).append(row.value)
    return series


def _chosen(names: list[str], wanted: list[str] | None) -> list[str]:
    if not wanted:
        return names
    chosen = []
    for want in wanted:
        found = [n for n in names if n == want or (want.endswith("/") and n.startswith(want))]
        if not found:
            raise RolloutError(
                Issue(
                    "--metric",
                    f"neither run has a metric {want!r}",
                    hint="`rollout runs metrics RUN_ID` lists a run's metrics",
                )
            )
        chosen += [n for n in found if n not in chosen]
    return chosen


_LOWER_IS_BETTER = ("loss", "kl", "_s", "wait", "staleness", "error", "perplexity")


def lower_is_better(name: str) -> bool:
    """Losses, divergences, seconds and waits: the less the better; everything else more."""
    leaf = name.rsplit("/", 1)[-1]
    return any(leaf.endswith(mark) or leaf.startswith(mark) for mark in _LOWER_IS_BETTER)


def compare_metric(
    name: str, a: list[float] | None, b: list[float] | None, last: int
) -> dict[str, Any]:
    """One metric of two runs (each its values in step order, or None if it lacks it)."""
    lower = lower_is_better(name)

    def summary(values: list[float] | None) -> dict[str, float] | None:
        if not values:
            return None
        tail = values[-last:]
        return {
            "last": values[-1],
            "best": min(values) if lower else max(values),
            "mean_last": sum(tail) / len(tail),
            "steps": len(values),
        }

    sa, sb = summary(a), summary(b)
    delta = ratio = None
    if sa and sb:
        delta = sb["mean_last"] - sa["mean_last"]
        ratio = sb["mean_last"] / sa["mean_last"] if sa["mean_last"] else None
    return {
        "metric": name,
        "better": "lower" if lower else "higher",
        "a": sa,
        "b": sb,
        "delta": delta,
        "ratio": ratio,
    }


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"


_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    """The values as a line of bar characters, lowest ▁ to highest █ (at most `width` of them:
    longer series are sampled evenly, first and last kept)."""
    if len(values) > width:
        values = [values[round(i * (len(values) - 1) / (width - 1))] for i in range(width)]
    low, high = min(values), max(values)
    if high == low:
        return _BARS[0] * len(values)
    top = len(_BARS) - 1
    return "".join(_BARS[round((value - low) / (high - low) * top)] for value in values)


@runs.command()
def cancel(run_id: RunIdArgument, store: StoreOption = None) -> None:
    """Ask a running run to stop; it stops at its next step and keeps its checkpoints."""
    with user_errors():
        check_run_id(run_id)
        with reading(store) as (the_store, location):
            record = find_run(the_store, run_id, location)
            if record.status != "running":
                raise RolloutError(
                    Issue(
                        "run id",
                        f"run {run_id!r} is {record.status}, not running: only a running run "
                        "can be cancelled",
                    )
                )
            the_store.request_cancel(run_id)
    stdout.print(f"cancel requested: {run_id} will stop at its next step")


def _status(record: RunRecord) -> str:
    return f"[{STATUS_STYLES[record.status]}]{record.status}[/]"


def _when(timestamp: float | None, layout: str = "%Y-%m-%d %H:%M:%S") -> str:
    return "" if timestamp is None else datetime.fromtimestamp(timestamp).strftime(layout)


def _duration(record: RunRecord) -> str:
    if record.started_at is None:
        return ""
    end = record.ended_at if record.ended_at is not None else time.time()
    seconds = max(0, round(end - record.started_at))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def _error_summary(error: str | None, limit: int = 80) -> str:
    """One line: a traceback's last line (the exception itself), else the message's first."""
    if not error or not error.strip():
        return ""
    lines = error.strip().splitlines()
    summary = lines[-1] if "Traceback (most recent call last)" in error else lines[0]
    return summary if len(summary) <= limit else summary[: limit - 3] + "..."
