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
from rollout.errors import Issue, RolloutError
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
    worker: Annotated[
        str | None,
        typer.Option(
            "--worker",
            metavar="RANK|NODE/LOCAL",
            help="Only this worker: its global rank (3), or its node and local rank (1/0), "
            "found in the run's plan.",
        ),
    ] = None,
    span: Annotated[
        str | None,
        typer.Option(
            "--span",
            metavar="NAME",
            help="Only lines written inside this span or phase (rollout, generate, score, "
            "learn, sync, checkpoint...; docs/observability.md).",
        ),
    ] = None,
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
    filters: dict[str, Any] = {
        "level": level.value if level else None,
        "rank": rank,
        "role": role,
        "span": span,
    }
    try:
        with user_errors():
            check_run_id(run_id)
            with reading(store) as (the_store, location):
                record = find_run(the_store, run_id, location)
                if worker is not None:
                    filters["rank"] = _worker_rank(worker, rank, record.plan_path)
                after_id = _print_last(the_store, run_id, lines, filters)
                if follow:
                    _follow(the_store, run_id, after_id, filters)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None  # Ctrl-C is how a user stops following: not an error


def _worker_rank(worker: str, rank: int | None, plan_path: str) -> int:
    """The global rank `--worker` names: RANK as it is, NODE/LOCAL through the run's plan (the
    ranks are placed there)."""
    node, slash, local = worker.partition("/")
    numbers = (node, local) if slash else (node,)
    if not all(part.isdigit() for part in numbers):
        raise RolloutError(
            Issue(
                "--worker",
                "is a global rank (3) or a node and its local rank (1/0)",
                value=worker,
            )
        )
    found = _placed_rank(int(node), int(local), plan_path, worker) if slash else int(node)
    if rank is not None and rank != found:
        raise RolloutError(
            Issue(
                "--worker",
                f"names rank {found}, but --rank asks for rank {rank}",
                hint="give one of them",
            )
        )
    return found


def _placed_rank(node: int, local: int, plan_path: str, worker: str) -> int:
    from rollout.planner.lockfile import read_plan  # only for NODE/LOCAL: keeps `logs` light

    try:
        plan = read_plan(plan_path, check_fresh=False)
    except RolloutError:
        raise RolloutError(
            Issue(
                "--worker",
                f"NODE/LOCAL is looked up in the run's plan, and {plan_path} cannot be read here",
                value=worker,
                hint="give the worker's global rank instead (--worker RANK)",
            )
        ) from None
    for process in plan.graph.processes:
        if (process.node, process.local_rank) == (node, local):
            return process.rank
    placed = ", ".join(f"{p.node}/{p.local_rank}" for p in plan.graph.processes)
    raise RolloutError(
        Issue("--worker", f"no worker {worker} in this run's plan (it has {placed})", value=worker)
    )


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
    where = f"{record.rank}/{record.role}" + (f"/{record.span}" if record.span else "")
    stdout.print(Text.assemble((stamp, "dim"), " ", level, " ", where, " ", record.message))
