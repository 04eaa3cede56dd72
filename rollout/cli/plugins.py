"""`rollout plugins`: list the plugins a config can name, try one on a sample, scaffold a new one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from rollout.cli.options import Format, FormatOption, local_path
from rollout.cli.render import stdout, user_errors
from rollout.errors import Issue, RolloutError
from rollout.inference.plugins import (
    KINDS,
    SCAFFOLD_KINDS,
    Trial,
    list_plugins,
    try_plugin,
    write_scaffold,
)

plugins = typer.Typer(
    name="plugins",
    help="List plugins, try one on sample input, scaffold a new one (docs/plugins.md).",
    no_args_is_help=True,
)

_RESULT_CHARS = 120


@plugins.command("list")
def list_command(
    kind: Annotated[
        str | None,
        typer.Option(metavar="KIND", help=f"Only this kind: {', '.join(KINDS)}."),
    ] = None,
    fmt: FormatOption = Format.text,
) -> None:
    """Built-in and installed (entry point) plugins: kind, name, source, version."""
    with user_errors(fmt.value):
        found = list_plugins(kind)
    if fmt is Format.json:
        rows = [
            {
                "kind": p.kind,
                "name": p.name,
                "source": p.source,
                "version": p.version,
                "target": p.target,
            }
            for p in found
        ]
        stdout.print_json(json.dumps(rows))
        return
    table = Table("kind", "name", "source", "version", box=None, pad_edge=False)
    for p in found:
        table.add_row(p.kind, escape(p.name), escape(p.source), escape(p.version or "-"))
    stdout.print(table)


@plugins.command("test")
def test_command(
    ref: Annotated[
        str,
        typer.Argument(
            metavar="REF",
            help="As a config writes it: a built-in or entry-point name, module:attr, or "
            "./file.py:attr (relative to --config-dir).",
        ),
    ],
    kind: Annotated[str, typer.Option(metavar="KIND", help=f"{', '.join(KINDS)}.")],
    sample: Annotated[
        str,
        typer.Option(
            metavar="FILE",
            help="Sample input, .json (a list of objects) or .jsonl; its format per kind is in "
            "docs/plugins.md.",
        ),
    ],
    config_dir: Annotated[
        str | None,
        typer.Option(
            metavar="DIR",
            help="Where ./file.py references start, as the config file's directory would. "
            "Default: the current directory.",
        ),
    ] = None,
    options: Annotated[
        str | None,
        typer.Option(
            metavar="JSON",
            help="The plugin's options as a JSON object, as the config's options table gives "
            "them (a reward's keywords, an environment's or built-in tool's constructor "
            "arguments).",
        ),
    ] = None,
    timeout_s: Annotated[
        float, typer.Option("--timeout-s", min=0.001, help="Limit of each call, in seconds.")
    ] = 30.0,
    seed: Annotated[
        int, typer.Option(help="The seed an environment's reset (or an engine) is given.")
    ] = 0,
    model: Annotated[
        str | None,
        typer.Option(
            metavar="MODEL",
            help="--kind engine: the model it generates with (builtin:NAME, a Hugging Face "
            "directory or a .gguf file). Default: builtin:tiny-llama.",
        ),
    ] = None,
    fmt: FormatOption = Format.text,
) -> None:
    """Run a plugin on sample input here: no GPU, no training (no model but an engine's).

    REF is resolved as a plan resolves it and called as a run calls it; what it returned and how
    long each call took are printed. Exit 2 when it fails to import, raises, hangs past
    --timeout-s or returns the wrong shape.
    """
    with user_errors(fmt.value):
        trial = try_plugin(
            ref,
            kind,
            local_path(sample, "--sample"),
            base_dir=local_path(config_dir, "--config-dir") or Path.cwd(),
            options=_options(options),
            timeout_s=timeout_s,
            seed=seed,
            model=model,
        )
    if fmt is Format.json:
        stdout.print_json(json.dumps(trial.to_dict(), default=str))
        return
    _render(trial)


@plugins.command("new")
def new_command(
    kind: Annotated[str, typer.Argument(metavar="KIND", help=", ".join(SCAFFOLD_KINDS) + ".")],
    name: Annotated[
        str, typer.Argument(metavar="NAME", help="The plugin's name: a Python identifier.")
    ],
    directory: Annotated[
        str | None,
        typer.Option(
            "--dir",
            metavar="DIR",
            help="Where to write the package (new or empty). Default: ./NAME.",
        ),
    ] = None,
) -> None:
    """Scaffold a package with one working plugin of KIND, its entry point, a sample and a test."""
    with user_errors():
        target = local_path(directory, "--dir") or Path(name)
        scaffold = write_scaffold(kind, name, target)
    stdout.print(f"[green]✓[/] wrote a {kind} plugin package in {escape(str(target))}:")
    for path in scaffold.files:
        stdout.print(f"  {escape(str(path.relative_to(target)))}")
    stdout.print(
        f"next: cd {escape(str(target))} && pytest && PYTHONPATH=src rollout plugins test "
        f"{scaffold.target} --kind {kind} --sample sample.jsonl "
        f"(or `pip install -e .`, then test it as {name!r})"
    )


@plugins.command("reload")
def reload_command(
    url: Annotated[
        str,
        typer.Option(
            metavar="URL",
            help="The `rollout serve --dev` server (its address, with or without /v1).",
        ),
    ] = "http://127.0.0.1:8000",
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            metavar="REF",
            help="The server's API key as a reference, env:NAME or file:/path (as serve takes it).",
        ),
    ] = None,
    fmt: FormatOption = Format.text,
) -> None:
    """Re-import a development server's engine plugin and swap its engine between requests.

    Only a server started with `rollout serve --dev` reloads; requests in flight finish on the
    old engine, the next ones use the new code. A training run never reloads: its plugins are
    frozen by plan.lock (edit, then plan again). Exit 2 when the server refuses or the new code
    does not load (the old engine then still serves).
    """
    from rollout.inference.plugins import reload_server

    with user_errors(fmt.value):
        answer = reload_server(url, api_key)
    if fmt is Format.json:
        stdout.print_json(json.dumps(answer))
        return
    old, new = answer["old"], answer["new"]
    stdout.print(f"[green]✓[/] reloaded {escape(answer['engine'])}")
    stdout.print(f"  old: {escape(_identity_text(old))}")
    stdout.print(f"  new: {escape(_identity_text(new))}")


def _identity_text(identity: dict[str, Any]) -> str:
    where = identity.get("path") or identity.get("module") or identity.get("ref")
    if identity.get("sha256"):
        return f"{where} sha256 {identity['sha256'][:12]}"
    return f"{where} {identity.get('distribution') or ''} {identity.get('version') or ''}".strip()


def _options(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise RolloutError(
            Issue(
                "--options",
                f"is not valid JSON: {error.msg}",
                value=text,
                hint="write a JSON object, e.g. '{\"tolerance\": 0.01}'",
            )
        ) from None
    if not isinstance(value, dict):
        raise RolloutError(
            Issue("--options", f"is a JSON {type(value).__name__}, not an object", value=text)
        )
    return value


def _render(trial: Trial) -> None:
    source = trial.identity or {}
    where = source.get("path") or source.get("module") or trial.ref
    version = f" {source['version']}" if source.get("version") else ""
    stdout.print(f"{trial.kind} {escape(trial.ref)} → {escape(str(where))}{escape(version)}")
    table = Table("call", "items", "time", "per item", "returned", box=None, pad_edge=False)
    for call in trial.calls:
        per_item = call.seconds / call.items if call.items else call.seconds
        table.add_row(
            escape(call.label),
            str(call.items),
            _duration(call.seconds),
            _duration(per_item),
            escape(_short(json.dumps(call.result, default=str))),
        )
    stdout.print(table)
    total = sum(call.seconds for call in trial.calls)
    items = sum(call.items for call in trial.calls)
    stdout.print(f"{len(trial.calls)} call(s), {items} item(s) in {_duration(total)}")


def _duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def _short(text: str) -> str:
    return text if len(text) <= _RESULT_CHARS else text[: _RESULT_CHARS - 1] + "…"
