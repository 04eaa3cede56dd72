"""`rollout memory`: the episodic memory a run's agents kept, as its checkpoints saved it."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from rollout.cli.options import Format, FormatOption
from rollout.cli.render import stdout, user_errors
from rollout.cli.runs import RunIdArgument, StoreOption
from rollout.errors import Issue, RolloutError

memory = typer.Typer(
    name="memory",
    help="Show the episodic memory a run's agents kept (saved with its checkpoints).",
    no_args_is_help=True,
)

StepOption = Annotated[
    int | None,
    typer.Option(
        "--step",
        help="The checkpoint to read (default: the newest committed one).",
        show_default=False,
    ),
]


@memory.command("list")
def list_(
    run_id: RunIdArgument,
    step: StepOption = None,
    store: StoreOption = None,
    fmt: FormatOption = Format.text,
) -> None:
    """The agents that have memory in a checkpoint, and how many entries each keeps."""
    from rollout.inference.memory import saved_memory

    with user_errors(fmt.value):
        at, saved = saved_memory(run_id, step, store)
    agents = {agent: len(entries) for agent, entries in saved["agents"].items()}
    if fmt is Format.json:
        stdout.print_json(json.dumps({"run_id": run_id, "step": at, "agents": agents}))
        return
    stdout.print(f"[bold]{escape(run_id)}[/] memory at step {at}: {len(agents)} agent(s)")
    for agent, count in agents.items():
        stdout.print(f"  {escape(agent)}  {count} entr{'y' if count == 1 else 'ies'}")


@memory.command()
def show(
    run_id: RunIdArgument,
    agent: Annotated[str, typer.Argument(help="The agent id (see `rollout memory list`).")],
    step: StepOption = None,
    store: StoreOption = None,
    fmt: FormatOption = Format.text,
) -> None:
    """One agent's entries, oldest first: the step that wrote each, its text and metadata."""
    from rollout.inference.memory import saved_memory

    with user_errors(fmt.value):
        at, saved = saved_memory(run_id, step, store)
        if agent not in saved["agents"]:
            known = ", ".join(sorted(saved["agents"])) or "none"
            raise RolloutError(
                Issue(
                    "agent",
                    f"no memory for agent {agent!r} at step {at} of {run_id} (agents: {known})",
                    value=agent,
                    hint=f"rollout memory list {run_id}",
                )
            )
    entries = saved["agents"][agent]
    if fmt is Format.json:
        body = {"run_id": run_id, "step": at, "agent": agent, "entries": entries}
        stdout.print_json(json.dumps(body))
        return
    stdout.print(
        f"[bold]{escape(agent)}[/] in {escape(run_id)} at step {at}: {len(entries)} entries"
    )
    table = Table(box=None, pad_edge=False, padding=(0, 2, 0, 0))
    for column in ("step", "text", "metadata"):
        table.add_column(column, overflow="fold")
    for entry in entries:
        table.add_row(
            str(entry["step"]),
            escape(entry["text"]),
            escape(json.dumps(entry["metadata"], sort_keys=True)) if entry["metadata"] else "",
        )
    stdout.print(table)
