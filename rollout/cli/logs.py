"""`rollout logs`: what a run's workers logged, read from the rows they write to the run store."""

from __future__ import annotations

import time
from datetime import datetime
from enum import Enum
from typing import Annotated, Any

import typer
from rich.text import Text

from rollout.cli.render import stdout, user_errors
from rollout.cli.runs import RunIdArgument, StoreOption, reading, reconcile_quietly
from rollout.storage import check_run_id, find_run
from rollout.storage.base import FINAL_STATUSES, LOG_LEVELS, LogRecord, RunStore

logs = typer.Typer(name="logs", help="Read a run's logs.", no_args_is_help=True)

LevelChoice = Enum("LevelChoice", {level: level for level in LOG_LEVELS}, type=str)

POLL_S = 0.5
PAGE = 1000
LEVEL_STYLES = {"debug": "dim", "info": "green", "warning": "yellow", "error": "bold red"}


@logs.command()
def tail(
    run_id: RunIdArgument,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines until the run ends.")
    ] = False,
    role: Annotated[
        str | None, typer.Option("--role", help="Only lines from this role (actor, learner...).")
    ] = None,
    rank: Annotated[int | None, typer.Option("--rank", min=0, help="Only this rank.")] = None,
    level: Annotated[
        LevelChoice | None,
        typer.Option("--level", case_sensitive=False, help="Only this level and above."),
    ] = None,
    lines: Annotated[
        int, typer.Option("--lines", "-n", min=0, help="How many recent lines to print first.")
    ] = 20,
    store: StoreOption = None,
) -> None:
    """Print a run's last log lines; with --follow, keep printing until the run ends."""
    filters = {"level": level.value if level else None, "rank": rank, "role": role}
    try:
        with user_errors():
            check_run_id(run_id)
            with reading(store) as (the_store, location):
                find_run(the_store, run_id, location)
                after_id = _print_last(the_store, run_id, lines, filters)
                if follow:
                    _follow(the_store, run_id, after_id, filters)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None  # Ctrl-C is how a user stops following: not an error


def _print_last(store: RunStore, run_id: str, count: int, filters: dict[str, Any]) -> int:
    """Print the last `count` matching lines; return the id to follow from."""
    newest = store.logs(run_id, newest_first=True, limit=max(count, 1), **filters)
    for record in reversed(newest[:count]):
        _print_line(record)
    return newest[0].id if newest else 0


def _follow(store: RunStore, run_id: str, after_id: int, filters: dict[str, Any]) -> None:
    """Poll until the run ends. The status is read before the lines, so every line written
    before the run ended is printed before returning."""
    while True:
        reconcile_quietly(store)  # a run whose owner died ends the follow, as lost
        run = store.get_run(run_id)
        ended = run is None or run.status in FINAL_STATUSES
        after_id = _print_new(store, run_id, after_id, filters)
        if ended:
            return
        time.sleep(POLL_S)


def _print_new(store: RunStore, run_id: str, after_id: int, filters: dict[str, Any]) -> int:
    while True:
        page = store.logs(run_id, after_id=after_id, limit=PAGE, **filters)
        for record in page:
            _print_line(record)
        if len(page) < PAGE:
            return page[-1].id if page else after_id
        after_id = page[-1].id


def _print_line(record: LogRecord) -> None:
    stamp = datetime.fromtimestamp(record.time).strftime("%H:%M:%S")
    level = (f"{record.level.upper():<7}", LEVEL_STYLES[record.level])
    where = f"{record.rank}/{record.role}"
    stdout.print(Text.assemble((stamp, "dim"), " ", level, " ", where, " ", record.message))
