"""`rollout plan`: validate, resolve plugins, inspect model/data/hardware, freeze plan.lock."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from rollout.cli.options import Format, FormatOption, SetOption, local_path
from rollout.cli.render import stderr, stdout, user_errors
from rollout.planner.memory import gib

plan_app = typer.Typer(
    invoke_without_command=True,
    no_args_is_help=False,
    help="Freeze a config into plan.lock (or show one with `rollout plan show`).",
)

OutputOption = Annotated[
    Path, typer.Option("--output", "-o", help="Where to write the plan.", show_default=True)
]


@plan_app.callback()
def plan(
    ctx: typer.Context,
    config: Annotated[
        str | None,
        typer.Option(
            "--config", "-c", help="Config file (.toml, .yaml/.yml or .json).", show_default=False
        ),
    ] = None,
    output: OutputOption = Path("plan.lock"),
    set_: SetOption = None,
    explain: Annotated[bool, typer.Option("--explain", help="Show the whole plan.")] = False,
    fmt: FormatOption = Format.text,
) -> None:
    """Validate CONFIG, resolve plugins, inspect the model, data and hardware, write plan.lock."""
    if ctx.invoked_subcommand is not None:
        return
    if config is None:
        stderr.print(
            "[bold red]error[/]: missing --config FILE (or use `rollout plan show plan.lock`)"
        )
        raise typer.Exit(2)
    from rollout.planner.builder import build_plan
    from rollout.planner.lockfile import write_plan

    with user_errors(fmt.value):
        the_plan = build_plan(local_path(config), overrides=set_ or [])
        write_plan(the_plan, output)
    if fmt is Format.json:
        stdout.print_json(
            json.dumps(
                {"plan": str(output), "run_id": the_plan.run_id, "plan_sha256": _lock_hash(output)}
            )
        )
        return
    if explain:
        from rollout.planner.explain import explain as render

        render(the_plan, stdout)
    used = sum(e.total_bytes for e in the_plan.memory)
    capacity = sum(e.capacity_bytes for e in the_plan.memory)
    stdout.print(
        f"[green]✓[/] wrote {output}: {the_plan.run_id} ({the_plan.config.algorithm.kind}, "
        f"{the_plan.derived.total_steps} steps, {the_plan.graph.world_size} "
        f"{the_plan.graph.device} process(es), ~{gib(used)} of {gib(capacity)})"
    )
    nnodes = the_plan.graph.nnodes
    if nnodes == 1:
        stdout.print(f"  next: rollout run --plan {output}")
    else:  # every node runs the same plan.lock, each with its own rank
        stdout.print(
            f"  next: copy {output} to each of the {nnodes} nodes, then on node K (0..{nnodes - 1})"
            f": rollout run --plan {output} --node-rank K"
        )


@plan_app.command("show")
def show(
    path: Annotated[str, typer.Argument(help="A plan.lock file.")] = "plan.lock",
) -> None:
    """Explain a plan.lock: roles, placement, memory, plugins, versions."""
    from rollout.planner.explain import explain as render
    from rollout.planner.lockfile import read_plan

    with user_errors():
        the_plan = read_plan(local_path(path, "plan.lock"), check_fresh=False)
    render(the_plan, stdout)


def _lock_hash(path: Path) -> str:
    return json.loads(path.read_text(encoding="utf-8"))["sha256"]
