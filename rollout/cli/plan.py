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
    probe: Annotated[
        int | None,
        typer.Option(
            "--probe",
            metavar="N",
            min=2,
            help="Sample N completions for each of a few of the run's first prompts with the "
            "starting model, score them, warn when no probed prompt's completions differ (the "
            "run could not learn) and estimate the time a step takes. Online kinds only.",
            show_default=False,
        ),
    ] = None,
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
        if probe is not None:
            _check_probe(the_plan)
        write_plan(the_plan, output)
    report = _probe(the_plan, probe, quiet=fmt is Format.json) if probe is not None else None
    if fmt is Format.json:
        body = {"plan": str(output), "run_id": the_plan.run_id, "plan_sha256": _lock_hash(output)}
        if report is not None:
            body["probe"] = _probe_json(report)
        stdout.print_json(json.dumps(body))
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
    if report is not None:
        _render_probe(the_plan, report)
    from rollout.planner.tools import sandbox_warnings

    warnings = sandbox_warnings(the_plan.tool_sandbox)
    for record in the_plan.rewards:
        if record.kind == "function":
            warnings += sandbox_warnings(record.sandbox, f"the reward {record.name!r}")
    for warning in warnings:
        stdout.print(f"[bold yellow]warning[/]: {warning}")
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


def _check_probe(the_plan) -> None:
    from rollout.config.algorithm import ONLINE_KINDS
    from rollout.errors import Issue, PlanError

    kind = the_plan.config.algorithm.kind
    if kind not in ONLINE_KINDS:
        raise PlanError(
            [
                Issue(
                    "--probe",
                    f"{kind} trains on a fixed dataset: there are no completions to probe",
                    hint="drop --probe (it is for grpo, rloo, ppo and reinforce_pp)",
                )
            ]
        )


def _probe(the_plan, completions: int, *, quiet: bool):
    from rollout.inference.probe import probe

    with user_errors():
        if quiet:
            return probe(the_plan, completions)
        with stderr.status(f"probing: {completions} completions for each of a few prompts..."):
            return probe(the_plan, completions)


def _render_probe(the_plan, report) -> None:
    from rich.table import Table

    table = Table(title=f"probe: {report.completions_per_prompt} completions per prompt")
    for column in ("prompt", "rewards", "mean", "spread"):
        table.add_column(column, justify="left" if column == "rewards" else "right")
    for i, group in enumerate(report.group_rewards):
        shown = " ".join(f"{r:.3g}" for r in group[:8]) + (" ..." if len(group) > 8 else "")
        spread = max(group) - min(group)
        table.add_row(
            str(i), shown, f"{sum(group) / len(group):.3g}", f"{spread:.3g}" if spread else "none"
        )
    stdout.print(table)
    steps = the_plan.derived.total_steps
    stdout.print(
        f"  a step: ~{report.step_s:.1f} s per process (measured: generating "
        f"{report.generate_s:.2f} s, scoring {report.score_s:.2f} s, one forward and backward "
        f"{report.train_s:.2f} s for {sum(len(g) for g in report.group_rewards)} completions); "
        f"{steps} steps: ~{_duration(report.step_s * steps)}"
    )
    for warning in report.warnings:
        stdout.print(f"[bold yellow]warning[/]: {warning}")
    if not report.warnings:
        stdout.print(
            f"  [green]✓[/] {len(report.group_rewards) - report.uniform_groups} of "
            f"{len(report.group_rewards)} probed prompts have completions that score differently"
        )


def _probe_json(report) -> dict:
    return {
        "completions_per_prompt": report.completions_per_prompt,
        "group_rewards": report.group_rewards,
        "uniform_groups": report.uniform_groups,
        "generate_s": report.generate_s,
        "score_s": report.score_s,
        "train_s": report.train_s,
        "step_s": report.step_s,
        "warnings": report.warnings,
    }


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _lock_hash(path: Path) -> str:
    return json.loads(path.read_text(encoding="utf-8"))["sha256"]
