"""`rollout eval`: score a model or a run's checkpoint on eval suites; a table and a JSON report."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from rollout.cli.bars import TokenRateBar
from rollout.cli.generate import Device
from rollout.cli.options import CheckpointOption, CheckpointStoreOption, ModelOption, local_path
from rollout.cli.render import stderr, stdout, user_errors


def eval_command(
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            "-c",
            metavar="PATH",
            help="An eval config: \\[model], \\[generation] and \\[\\[suites]] (docs/eval.md). "
            "Flags override its settings.",
        ),
    ] = None,
    model: ModelOption = None,
    checkpoint: CheckpointOption = None,
    store: CheckpointStoreOption = None,
    suite: Annotated[
        list[str] | None,
        typer.Option(
            help="Without --config: the suite to run (gsm8k, ifeval, mmlu, mmlu_loglik). With "
            "it: a suite of the config to run (repeatable; default all)."
        ),
    ] = None,
    data: Annotated[
        str | None,
        typer.Option(help="The suite's rows, .jsonl or .parquet (replaces the config's)."),
    ] = None,
    samples: Annotated[
        int | None, typer.Option(help="Completions sampled per row (n of pass@k).")
    ] = None,
    k: Annotated[
        list[int] | None,
        typer.Option(
            "--k", help="Report pass@k and maj@k at this k (repeatable; default 1 and --samples)."
        ),
    ] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Most tokens per completion.")] = None,
    temperature: Annotated[
        float | None,
        typer.Option(help="Sampling temperature (default 0 with one sample, else the config's)."),
    ] = None,
    limit: Annotated[int | None, typer.Option(help="Only the first N rows of each suite.")] = None,
    chat_template: Annotated[
        bool | None,
        typer.Option(
            "--chat-template/--no-chat-template",
            help="Wrap prompts in the model's chat template. Default: when the model has one.",
            show_default=False,
        ),
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Sampling seed (default: the config's, else 0).")
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--max-batch-size", min=1, help="Most completions the engine decodes together."
        ),
    ] = None,
    device: Annotated[Device, typer.Option(help="Where the model runs.")] = Device.auto,
    report: Annotated[
        str | None, typer.Option(help="Write the JSON report here (scores and every completion).")
    ] = None,
    run: Annotated[
        str | None,
        typer.Option(
            help="Record the scores in the run store as metrics of this run "
            "(eval/<suite>/<score>) at the step of --checkpoint, which must be one of its "
            "checkpoints."
        ),
    ] = None,
) -> None:
    """Score a model on eval suites (GSM8K, IFEval, MMLU-style): pass@k, maj@k, per category."""
    from rollout.inference.evaluate import EvalOptions, evaluate

    with user_errors():
        options = EvalOptions(
            config=local_path(config),
            model=model,
            checkpoint=checkpoint,
            store=store,
            suites=tuple(suite or ()),
            data=data,
            samples=samples,
            k=tuple(k) if k else None,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            limit=limit,
            chat_template=chat_template,
            seed=seed,
            batch_size=batch_size,
            device=device.value,
            report=local_path(report, "--report"),
            run=run,
        )
    view = _ProgressView()
    with user_errors():
        try:
            result = evaluate(options, view.hooks())
        finally:
            view.stop()
    stdout.print(results_table(result.report))
    where = f"; report in {escape(str(options.report))}" if options.report else ""
    stdout.print(f"[green]✓[/] evaluated {escape(result.model)} in {result.seconds:.1f} s{where}")


def results_table(report: dict) -> Table:
    """One line per suite, then one per category of it: n and every metric the suites have."""
    metrics: list[str] = []
    for suite in report["suites"]:
        metrics += [name for name in suite["metrics"] if name not in metrics]
    table = Table(title=f"eval of {escape(report['model'])}", title_justify="left")
    table.add_column("suite", style="bold")
    table.add_column("category")
    table.add_column("n", justify="right")
    for name in metrics:
        table.add_column(name, justify="right")
    for suite in report["suites"]:
        table.add_row(
            escape(suite["name"]), "all", str(suite["n"]), *_cells(suite["metrics"], metrics)
        )
        for category, found in suite["categories"].items():
            table.add_row("", escape(category), str(found["n"]), *_cells(found["metrics"], metrics))
    return table


def _cells(values: dict, metrics: list[str]) -> list[str]:
    # "-": not measured for this suite (no answers to vote on, or no such k).
    return [f"{values[name]:.3f}" if values.get(name) is not None else "-" for name in metrics]


class _ProgressView:
    """A progress bar per suite (rows done, tokens/s), fed by the job's hooks."""

    def __init__(self) -> None:
        self.bar = TokenRateBar(stderr, "rows")

    def hooks(self):  # -> rollout.inference.evaluate.Hooks
        from rollout.inference.evaluate import Hooks

        return Hooks(
            on_status=stderr.print,
            on_suite=self.suite,
            on_rows=self.bar.update,
            on_suite_done=lambda name: None,
        )

    def suite(self, name: str, rows: int, samples: int) -> None:
        stderr.print(f"suite {escape(name)}: {rows} rows, {samples} sample(s) each")
        self.bar.add_task(escape(name), total=rows)

    def stop(self) -> None:
        self.bar.stop()
