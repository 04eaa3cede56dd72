"""`rollout memory`: the episodic memory a run's agents kept, as its checkpoints saved it."""

from __future__ import annotations

import json
from typing import Annotated, Any

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
    with user_errors(fmt.value):
        at, saved = _saved(run_id, step, store)
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
    with user_errors(fmt.value):
        at, saved = _saved(run_id, step, store)
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


def _saved(run_id: str, step: int | None, store: str | None) -> tuple[int, dict[str, Any]]:
    """(step, the memory.json) of the newest committed checkpoint, or of `step`."""
    from rollout.files import open_binary
    from rollout.harness.memory import FILE, MEMORY_DIR
    from rollout.inference.checkpoints import run_checkpoints

    found = run_checkpoints(run_id, store)
    committed = [c for c in found.found if not c.problems]
    if step is not None:
        committed = [c for c in committed if c.step == step]
    if not committed:
        which = f"step {step}" if step is not None else "any step"
        raise RolloutError(
            Issue(
                "run id",
                f"{run_id} has no committed checkpoint at {which} under {found.root}",
                value=run_id,
                hint=f"rollout checkpoints list {run_id}",
            )
        )
    newest = committed[-1]
    files = (newest.manifest or {}).get("files", {})
    name = f"{MEMORY_DIR}/{FILE}"
    if name not in files:
        raise RolloutError(
            Issue(
                "run id",
                f"the checkpoint at step {newest.step} of {run_id} holds no episodic memory: its "
                "environment keeps none (an environment asks for it with a `memory` parameter)",
                value=run_id,
            )
        )
    with open_binary(f"{str(newest.location).rstrip('/')}/{name}") as handle:
        return newest.step, json.loads(handle.read().decode("utf-8"))
