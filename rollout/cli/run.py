"""`rollout run`: verify a plan.lock (hash, format, freshness), then execute it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rollout.cli.app import app
from rollout.cli.options import SetOption
from rollout.cli.render import stderr, stdout, user_errors
from rollout.errors import Issue, RolloutError

EXIT_FAILED = 1
EXIT_STOPPED = 130


@app.command()
def run(
    plan: Annotated[
        Path | None, typer.Option("--plan", "-p", help="The plan.lock written by `rollout plan`.")
    ] = None,
    config: Annotated[
        Path | None,
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
    from rollout.cli.progress import live_progress, summary
    from rollout.executor.launch import run_plan
    from rollout.storage import open_store

    with user_errors():
        plan_path = _plan_path(plan, config, set_ or [])
        progress, bar = live_progress(stdout)
        try:
            record = run_plan(plan_path, progress=progress)
        finally:
            bar.stop()
    store = open_store(_store_of(plan_path))
    try:
        stdout.print(summary(record, store))
    finally:
        store.close()
    if record.status == "failed":
        stderr.print(f"[bold red]run failed[/]: {record.error}")
        raise typer.Exit(EXIT_FAILED)
    if record.status == "stopped":
        stderr.print(f"[yellow]stopped[/]: resume with `rollout run --plan {plan_path}`")
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

    the_plan = build_plan(config, overrides=overrides)
    path = Path(the_plan.derived.run_dir) / "plan.lock"
    the_plan.write(str(path))
    stdout.print(f"planned {the_plan.run_id} -> {path}")
    return path


def _store_of(plan_path: Path) -> str:
    from rollout.planner.definition import Plan

    return Plan.from_file(str(plan_path), check_fresh=False).derived.store
