"""`rollout checkpoints`: list a run's checkpoints, verify them, export one as a plain model."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from rollout.cli.options import Format, FormatOption
from rollout.cli.render import stderr, stdout, user_errors
from rollout.cli.runs import RunIdArgument, StoreOption
from rollout.errors import USER_ERROR_EXIT_CODE

checkpoints = typer.Typer(
    name="checkpoints",
    help="List, verify and export a run's checkpoints.",
    no_args_is_help=True,
)

STATE_STYLES = {"committed": "green", "damaged": "bold red", "uncommitted": "yellow"}


@checkpoints.command("list")
def list_(
    run_id: RunIdArgument, store: StoreOption = None, fmt: FormatOption = Format.text
) -> None:
    """Every checkpoint of a run under its artifacts root: step, size, state, the store's record.

    Sizes and presence are checked against each manifest; `verify` checks the hashes too."""
    from rollout.inference.checkpoints import run_checkpoints

    with user_errors(fmt.value):
        found = run_checkpoints(run_id, store)
    rows = [
        {
            "step": checkpoint.step,
            "state": checkpoint.state,
            "bytes": _size(checkpoint.manifest),
            "location": str(checkpoint.location),
            "recorded_at": (
                found.records[checkpoint.step].time if checkpoint.step in found.records else None
            ),
            "problems": checkpoint.problems,
        }
        for checkpoint in found.found
    ]
    if fmt is Format.json:
        stdout.print_json(json.dumps({"run_id": run_id, "root": found.root, "checkpoints": rows}))
        return
    stdout.print(f"[bold]{escape(run_id)}[/] checkpoints under {escape(found.root)}")
    if not rows:
        stdout.print("no checkpoints yet")
        return
    table = Table(box=None, pad_edge=False, padding=(0, 2, 0, 0))
    for column in ("step", "state", "size", "recorded", "problems"):
        table.add_column(column, no_wrap=column != "problems")
    for row in rows:
        table.add_row(
            str(row["step"]),
            f"[{STATE_STYLES[row['state']]}]{row['state']}[/]",
            _human(row["bytes"]),
            _when(row["recorded_at"]),
            escape("; ".join(row["problems"])),
        )
    stdout.print(table)


@checkpoints.command()
def verify(
    location: Annotated[
        str,
        typer.Argument(
            metavar="PATH_OR_URL",
            help="A checkpoint (…/step-000020), or a root holding several (…/checkpoints, "
            "s3://bucket/prefix): every file against its manifest's size and sha256.",
        ),
    ],
    fmt: FormatOption = Format.text,
) -> None:
    """Check checkpoints against their manifests; exit 0 when all are good, 2 with the problems."""
    from rollout.inference.checkpoints import verify as verify_checkpoints

    with user_errors(fmt.value):
        report = verify_checkpoints(location, progress=_progress)
    bad = {where: found for where, found in report.items() if found}
    if fmt is Format.json:
        stdout.print_json(json.dumps({"checkpoints": report, "good": not bad}))
    else:
        for where, found in report.items():
            if found:
                stdout.print(f"[bold red]damaged[/]  {escape(where)}")
                for problem in found:
                    stdout.print(f"  {escape(problem)}")
            else:
                stdout.print(f"[green]good[/]     {escape(where)}")
    if bad:
        raise typer.Exit(USER_ERROR_EXIT_CODE)


@checkpoints.command()
def export(
    target: Annotated[
        str,
        typer.Argument(
            metavar="RUN_ID[:STEP]",
            help="A run id (its newest committed checkpoint) or RUN_ID:STEP.",
        ),
    ],
    to: Annotated[
        str,
        typer.Option(
            "--to",
            metavar="DIR_OR_URL",
            help="Where the model goes: a new local directory or an object-store URL.",
            show_default=False,
        ),
    ],
    store: StoreOption = None,
) -> None:
    """Write a checkpoint as a plain Hugging Face model directory (with LoRA, the merged model),
    loadable by transformers without rollout; the checkpoint is verified first."""
    from rollout.inference.checkpoints import export as export_checkpoint

    with user_errors():
        chosen, destination = export_checkpoint(target, to, store, progress=_progress)
    stdout.print(
        f"exported step {chosen.step} ({escape(str(chosen.location))}) to {escape(destination)}"
    )


def _progress(message: str) -> None:
    stderr.print(f"[dim]{escape(message)}…[/]")


def _size(manifest: dict | None) -> int | None:
    if manifest is None:
        return None
    return sum(entry["size"] for entry in manifest["files"].values())


def _human(size: int | None) -> str:
    if size is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return ""


def _when(timestamp: float | None) -> str:
    return "" if timestamp is None else datetime.fromtimestamp(timestamp).strftime("%m-%d %H:%M:%S")
