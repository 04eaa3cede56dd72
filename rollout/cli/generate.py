"""`rollout generate`: completions for a file of prompts, with a progress bar; re-run to resume."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from rollout.cli.bars import TokenRateBar
from rollout.cli.options import (
    CheckpointOption,
    CheckpointStoreOption,
    ModelOption,
    SetOption,
    local_path,
)
from rollout.cli.render import stderr, stdout, user_errors
from rollout.files import is_url

EXIT_INTERRUPTED = 130


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


def generate(
    prompts: Annotated[
        str,
        typer.Option(
            "--prompts",
            help="JSONL or Parquet file of prompts: a local path (relative to the current "
            "directory, also with --config) or fsspec URL.",
        ),
    ],
    out: Annotated[
        str,
        typer.Option(
            "--out",
            "-o",
            help="Output file, .jsonl or .parquet (by extension): a local path, or an s3:// or "
            "gs:// URL (written locally, uploaded whole when every prompt is done).",
        ),
    ],
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            "-c",
            metavar="PATH",
            help="A config to take \\[model], \\[generation] and the \\[data] prompt settings from.",
        ),
    ] = None,
    set_: SetOption = None,
    model: ModelOption = None,
    checkpoint: CheckpointOption = None,
    store: CheckpointStoreOption = None,
    field: Annotated[
        str | None,
        typer.Option(
            help="The record field holding the prompt (text or chat messages). Default: prompt, "
            "or the config's data.fields.prompt."
        ),
    ] = None,
    chat_template: Annotated[
        bool | None,
        typer.Option(
            "--chat-template/--no-chat-template",
            help="Wrap prompts in the model's chat template. Default: when the model has one.",
            show_default=False,
        ),
    ] = None,
    system_prompt: Annotated[
        str | None, typer.Option(help="A system message before every prompt (chat template only).")
    ] = None,
    n: Annotated[int, typer.Option("--n", "-n", min=1, help="Samples per prompt.")] = 1,
    temperature: Annotated[
        float | None, typer.Option(help="Sampling temperature; 0 is greedy.")
    ] = None,
    top_p: Annotated[
        float | None, typer.Option(help="Nucleus sampling mass; 1 disables it.")
    ] = None,
    top_k: Annotated[
        int | None, typer.Option(help="Sample among the k likeliest tokens; 0 disables.")
    ] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Most tokens per completion.")] = None,
    stop: Annotated[
        list[str] | None, typer.Option(help="End a completion at this string (repeatable).")
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--max-batch-size",
            "--batch-size",
            min=1,
            help="Most completions the engine decodes together, also the completions of one "
            "resumable chunk. Default: the config's generation.max_batch_size, else hf 32, "
            "vllm 256.",
        ),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            metavar="REF",
            help="Generation backend: hf, vllm, or an engine plugin ('./engine.py:make' from the "
            "current directory, 'package.module:make', or a 'rollout.engines' entry point). "
            "Default: the config's generation.engine, else hf.",
        ),
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Sampling seed (default: the config's, else 0).")
    ] = None,
    logprobs: Annotated[
        bool, typer.Option("--logprobs", help="Include per-token log-probs.")
    ] = False,
    carry: Annotated[
        list[str] | None,
        typer.Option(
            help="Prompt record fields to copy into the output (repeatable; default all)."
        ),
    ] = None,
    no_carry: Annotated[bool, typer.Option("--no-carry", help="Copy no prompt fields.")] = False,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N prompts.")] = None,
    device: Annotated[Device, typer.Option(help="Where the model runs.")] = Device.auto,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Start over, replacing --out and its progress.")
    ] = False,
) -> None:
    """Sample completions for every prompt of a file. Re-run the same command to resume."""
    from rollout.inference.batch import GenerateOptions
    from rollout.inference.batch import generate as run_job

    with user_errors():
        config_path = local_path(config)
        # A URL stays text: a Path would fold its `//`. It is staged locally and uploaded whole.
        out_path = out if is_url(out) else local_path(out, "--out")
    options = GenerateOptions(
        prompts=prompts,
        out=out_path,
        config=config_path,
        overrides=tuple(set_ or ()),
        model=model,
        checkpoint=checkpoint,
        store=store,
        field=field,
        chat_template=chat_template,
        system_prompt=system_prompt,
        n=n,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        stop=tuple(stop) if stop else None,
        batch_size=batch_size,
        engine=engine,
        seed=seed,
        logprobs=logprobs,
        carry=() if no_carry else (tuple(carry) if carry else None),
        limit=limit,
        device=device.value,
        overwrite=overwrite,
    )
    view = _ProgressView()
    with user_errors():
        try:
            result = run_job(options, view.hooks())
        except KeyboardInterrupt:
            if view.running:
                stderr.print(
                    f"[yellow]interrupted[/]: {view.done} of {view.total} prompts are in {out}; "
                    "run the same command again to continue"
                )
            else:
                stderr.print("[yellow]interrupted[/] before generating anything")
            view.stop()
            raise typer.Exit(EXIT_INTERRUPTED) from None
        finally:
            view.stop()
    if result.already_complete:
        stdout.print(
            f"[green]✓[/] {result.out} is already complete: {result.records} records for "
            f"{result.prompts} prompts (pass --overwrite to generate again)"
        )
        return
    rate = result.generated_tokens / result.seconds if result.seconds else 0.0
    resumed = f", resumed after {result.resumed_from}" if result.resumed_from else ""
    stdout.print(
        f"[green]✓[/] wrote {result.out}: {result.records} records for {result.prompts} prompts"
        f"{resumed}; {result.generated_tokens} tokens in {result.seconds:.1f} s ({rate:.1f} tok/s)"
    )


class _ProgressView:
    """A rich progress bar (prompts done, tokens/s, time left) fed by the job's hooks."""

    def __init__(self) -> None:
        self.bar = TokenRateBar(stderr, "")
        self.done = self.total = 0

    @property
    def running(self) -> bool:
        return self.bar.running

    def hooks(self):  # -> rollout.inference.batch.Hooks
        from rollout.inference.batch import Hooks

        return Hooks(on_status=stderr.print, on_start=self.start, on_chunk=self.chunk)

    def start(self, job) -> None:
        self.done, self.total = job.prompts_done, job.prompts
        resumed = f", resuming after {job.prompts_done} done" if job.prompts_done else ""
        stderr.print(
            f"generating {job.samples_per_prompt} sample(s) for each of {job.prompts} prompts "
            f"with {job.model} ({job.engine}, {job.device}) -> {job.out}{resumed}"
        )
        self.bar.add_task("prompts", total=job.prompts, completed=job.prompts_done)

    def chunk(self, prompts_done: int, new_tokens: int) -> None:
        self.done = prompts_done
        self.bar.update(prompts_done, new_tokens)

    def stop(self) -> None:
        self.bar.stop()
