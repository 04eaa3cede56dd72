"""`rollout report RUN_ID`: a run's curves, step times, evaluation scores, plan and sample
completions as one static HTML page that opens from disk (docs/reports.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from rollout.cli.options import local_path
from rollout.cli.render import stdout, user_errors
from rollout.cli.runs import RunIdArgument, StoreOption, reading
from rollout.errors import Issue, RolloutError
from rollout.reports.render import write_report
from rollout.storage import check_run_id, find_run

OutOption = Annotated[
    str | None,
    typer.Option(
        "--out",
        "-o",
        metavar="DIR",
        help="Directory to write index.html into (created). Default: reports/RUN_ID.",
        show_default=False,
    ),
]


def report(run_id: RunIdArgument, out: OutOption = None, store: StoreOption = None) -> None:
    """Write a static HTML report of a run (one index.html, nothing fetched when opened)."""
    with user_errors():
        check_run_id(run_id)
        directory = local_path(out, "--out", hint="write it locally, then upload it") or Path(
            "reports", run_id
        )
        if directory.exists() and not directory.is_dir():
            raise RolloutError(Issue("--out", "is a file, not a directory", value=str(directory)))
        with reading(store) as (the_store, location):
            record = find_run(the_store, run_id, location)
            try:
                path = write_report(the_store, record, directory)
            except OSError as error:
                raise RolloutError(
                    Issue(
                        "--out",
                        f"cannot write the report: {error.strerror or error}",
                        value=str(directory),
                    )
                ) from None
    size = path.stat().st_size
    stdout.print(f"wrote {escape(str(path))} ({size / 1e6:.2f} MB); open it in a browser")
