"""`rollout snapshot`: save a run (plan, newest checkpoint, records) and restore it as a new run,
on the same or another store and artifacts (docs/snapshots.md)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from rollout.cli.render import stderr, stdout, user_errors
from rollout.cli.runs import RunIdArgument, StoreOption

snapshot = typer.Typer(
    name="snapshot",
    help="Save a run to a directory or object store; restore it as a new run.",
    no_args_is_help=True,
)


def _say(line: str) -> None:
    stderr.print(f"[dim]{escape(line)}[/]")


@snapshot.command()
def save(
    run_id: RunIdArgument,
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            metavar="DIR_OR_URL",
            help="Where the snapshot goes: a new local directory, s3://... or gs://... "
            "Default: <artifacts>/snapshots/<run>-step-<N>.",
            show_default=False,
        ),
    ] = None,
    store: StoreOption = None,
) -> None:
    """Snapshot a run, running or not: its plan, newest committed checkpoint (step N) and its
    records up to step N; with snapshot.process, its live processes too (CRIU)."""
    from rollout.snapshots.save import save_snapshot
    from rollout.storage import default_store_location

    with user_errors():
        saved = save_snapshot(
            run_id, store_location=store or default_store_location(), to=to, say=_say
        )
    if saved.status == "running":
        stdout.print(
            f"{escape(run_id)} is still running: the snapshot holds step {saved.step} and the "
            "records up to it; a restored run redoes the steps after it"
        )
    stdout.print(
        f"[green]✓[/] snapshot of {escape(run_id)} at step {saved.step}: {escape(saved.location)}"
    )


@snapshot.command()
def restore(
    snapshot_location: Annotated[
        str,
        typer.Argument(
            metavar="SNAPSHOT", help="A snapshot's directory or URL, as `snapshot save` printed."
        ),
    ],
    new_run: Annotated[
        str, typer.Option("--as", metavar="NEW_RUN", help="The new run's id.", show_default=False)
    ],
    store: Annotated[
        str | None,
        typer.Option(
            "--store",
            metavar="LOCATION",
            help="The new run's store: sqlite:/path/to/rollout.db or postgres:env:NAME. "
            "Default: the snapshotted run's.",
            show_default=False,
        ),
    ] = None,
    artifacts: Annotated[
        str | None,
        typer.Option(
            "--artifacts",
            metavar="DIR_OR_URL",
            help="Where the new run's checkpoints go: a directory, s3://... or gs://... "
            "Default: inside the new run's directory.",
            show_default=False,
        ),
    ] = None,
    output_dir: Annotated[
        str | None,
        typer.Option(
            "--output-dir",
            metavar="DIR",
            help="The directory the new run's directory goes in. Default: the old run's.",
            show_default=False,
        ),
    ] = None,
    plan_out: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            metavar="PLAN.lock",
            help="Where the new plan goes. Default: <run directory>/plan.lock.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Create a new run that continues from a snapshot: `rollout run --plan` then resumes it."""
    from rollout.snapshots.restore import restore_snapshot

    with user_errors():
        restored = restore_snapshot(
            snapshot_location,
            new_run_id=new_run,
            store=store,
            artifacts=artifacts,
            output_dir=output_dir,
            plan_out=plan_out,
            say=_say,
        )
    stdout.print(
        f"[green]✓[/] {escape(restored.run_id)} continues from step {restored.step}; "
        f"run it with: rollout run --plan {escape(str(restored.plan_path))}"
    )
