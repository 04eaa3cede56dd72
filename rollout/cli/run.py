"""`rollout run`: verify a plan.lock (hash, format, freshness), then execute it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from rollout.cli.options import SetOption, local_path
from rollout.cli.render import stderr, stdout, user_errors
from rollout.errors import Issue, RolloutError

EXIT_FAILED = 1
EXIT_STOPPED = 130


def run(
    plan: Annotated[
        str | None, typer.Option("--plan", "-p", help="The plan.lock written by `rollout plan`.")
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            "-c",
            help="Plan this config first (plan.lock goes into the run directory), then run it.",
        ),
    ] = None,
    set_: SetOption = None,
) -> None:
    """Run a plan to the end with a progress bar; re-running a plan resumes it.

    Refuses a plan edited by hand, a stale plan, or an unknown format.
    """
    from rollout.cli.progress import RunView, summary
    from rollout.executor.launch import run_plan
    from rollout.storage import open_store

    view = RunView(stdout, stderr)
    with user_errors():
        plan_path = _plan_path(local_path(plan, "--plan"), local_path(config), set_ or [])
        try:
            record = run_plan(plan_path, progress=view.callbacks)
        finally:
            view.stop()
    if view.shows_progress:
        store = open_store(_store_of(plan_path))
        try:
            table = summary(record, store)
        finally:
            store.close()
        if table is not None:
            stdout.print(table)
    if record.status in ("failed", "lost"):
        # The error is a traceback or a message quoting code: printed as it is, not as markup.
        stderr.print(f"[bold red]run {record.status}[/]: {escape(record.error or '')}")
        raise typer.Exit(EXIT_FAILED)
    if record.status == "stopped":
        stderr.print(
            f"[yellow]stopped[/]: resume with `rollout run --plan {escape(str(plan_path))}`"
        )
        raise typer.Exit(EXIT_STOPPED)
    stdout.print(f"[green]✓[/] {record.run_id} finished; logs: rollout logs tail {record.run_id}")


def _plan_path(plan: Path | None, config: Path | None, overrides: list[str]) -> Path:
    if (plan is None) == (config is None):
        raise RolloutError(
            Issue(
                "rollout run",
                "give exactly one of --plan PLAN.lock or --config CONFIG",
                hint="e.g. rollout run --config run.toml",
            )
        )
    if plan is not None:
        return plan
    from rollout.planner.builder import build_plan
    from rollout.planner.lockfile import write_plan

    the_plan = build_plan(config, overrides=overrides)
    path = Path(the_plan.derived.run_dir) / "plan.lock"
    write_plan(the_plan, path)
    stdout.print(f"planned {the_plan.run_id} -> {path}")
    return path


def _store_of(plan_path: Path) -> str:
    from rollout.planner.lockfile import read_plan

    return read_plan(plan_path, check_fresh=False).derived.store
