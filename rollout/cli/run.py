"""`rollout run`: verify a plan.lock (hash, format, freshness), then execute it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rollout.cli.app import app
from rollout.cli.render import stderr, stdout, user_errors


@app.command()
def run(
    plan: Annotated[
        Path, typer.Option("--plan", "-p", help="The plan.lock written by `rollout plan`.")
    ] = Path("plan.lock"),
) -> None:
    """Run a plan. Refuses a plan edited by hand, a stale plan, or an unknown format."""
    from rollout.executor.preflight import verify_plan

    with user_errors():
        the_plan = verify_plan(plan)
    stdout.print(
        f"[green]✓[/] {plan} verified: {the_plan.run_id} (sha256 intact, plugins, data "
        "and versions unchanged since planning)"
    )
    stderr.print(
        "[yellow]rollout run[/]: this version verifies plans but does not execute them "
        "yet; the executor lands in the next release."
    )
    raise typer.Exit(1)
