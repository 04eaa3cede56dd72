"""`rollout run`: verify a plan.lock (hash, format, freshness), then execute it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from rollout.cli.options import SetOption, local_path
from rollout.cli.render import stderr, stdout, user_errors
from rollout.errors import Issue, RolloutError

if TYPE_CHECKING:
    from rollout.executor.join import NodeOutcome
    from rollout.storage.base import RunRecord

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
    node_rank: Annotated[
        int | None,
        typer.Option(
            "--node-rank",
            help="This machine's place among the plan's cluster.nnodes nodes: 0 owns the run, "
            "1..nnodes-1 join it. Every node runs the same plan.lock (SLURM: $SLURM_NODEID; "
            "a Kubernetes indexed Job: $JOB_COMPLETION_INDEX).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run a plan to the end with a progress bar; re-running a plan resumes it.

    Refuses a plan edited by hand, a stale plan, or an unknown format.
    """
    from rollout.cli.progress import RunView
    from rollout.executor.launch import run_plan

    view = RunView(stdout, stderr)
    with user_errors():
        _check_node_option(node_rank, config)
        plan_path = _plan_path(local_path(plan, "--plan"), local_path(config), set_ or [])
        try:
            if node_rank:
                from rollout.executor.join import join_run

                outcome = join_run(plan_path, node_rank, progress=view.callbacks)
            else:
                record = run_plan(plan_path, progress=view.callbacks)
        finally:
            view.stop()
    if node_rank:
        _end_joined(outcome, plan_path)
        return
    _end(record, plan_path, view.shows_progress)


def _end(record: RunRecord, plan_path: Path, shows_progress: bool) -> None:
    """Node 0's last word: the summary, the run's status, its exit code."""
    from rollout.cli.progress import summary
    from rollout.storage import open_store

    if shows_progress:
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


def _end_joined(outcome: NodeOutcome, plan_path: Path) -> None:
    """A joining node's last word: the run's outcome as node 0 recorded it, and this node's own
    error where it says more; the exit code is the run's (this node's if node 0 never ended it)."""
    node = f"node {outcome.node_rank}"
    if outcome.final and outcome.record is not None:
        record = outcome.record
        if record.status == "finished":
            stdout.print(f"[green]✓[/] {record.run_id} finished ({node} done)")
            return
        if record.status == "stopped":
            stderr.print(f"[yellow]stopped[/] ({node}): node 0 restarts the run")
            raise typer.Exit(EXIT_STOPPED)
        stderr.print(f"[bold red]run {record.status}[/]: {escape(record.error or '')}")
        if outcome.error and outcome.error != record.error and outcome.status == "failed":
            stderr.print(f"[bold red]{node}[/]: {escape(outcome.error)}")
        raise typer.Exit(EXIT_FAILED)
    if outcome.status == "finished" and outcome.forwarded:
        stdout.print(
            f"[green]✓[/] {node}: its workers finished, their records forwarded to node 0's "
            "SQLite run store; node 0 records the run's end (`rollout runs show` there)"
        )
        return
    if outcome.status == "finished":
        stdout.print(
            f"[green]✓[/] {node}: its workers finished; node 0 has not recorded the run's end "
            "yet (`rollout runs show` will)"
        )
        return
    if outcome.status == "stopped":
        stderr.print(
            f"[yellow]stopped[/] ({node}): resume with "
            f"`rollout run --plan {escape(str(plan_path))} --node-rank {outcome.node_rank}`"
        )
        raise typer.Exit(EXIT_STOPPED)
    stderr.print(f"[bold red]{node} failed[/]: {escape(outcome.error or '')}")
    raise typer.Exit(EXIT_FAILED)


def _check_node_option(node_rank: int | None, config: str | None) -> None:
    if node_rank is None:
        return
    if node_rank < 0:
        raise RolloutError(
            Issue(
                "--node-rank",
                "a node rank counts from 0 (node 0 owns the run)",
                value=node_rank,
                hint="give 0 .. cluster.nnodes - 1",
            )
        )
    if config is not None:
        raise RolloutError(
            Issue(
                "--node-rank",
                "takes --plan: every node runs the same plan.lock, and --config would plan a "
                "new run on each",
                value=node_rank,
                hint="rollout plan --config run.toml -o plan.lock once, copy plan.lock to every "
                "node, then rollout run --plan plan.lock --node-rank K on each",
            )
        )


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
