"""`rollout validate`: schema and cross-field checks only. No torch, no plugins, no model."""

from __future__ import annotations

import json

from rollout.cli.options import ConfigOption, Format, FormatOption, SetOption, local_path
from rollout.cli.render import stdout, user_errors
from rollout.config import load_config
from rollout.config.root import RunConfig


def validate(config: ConfigOption, set_: SetOption = None, fmt: FormatOption = Format.text) -> None:
    """Check a config: every mistake at once, each with its path and a fix. Exit 2 if any."""
    with user_errors(fmt.value):
        run_config = load_config(local_path(config), set_ or [])
    if fmt is Format.json:
        stdout.print_json(
            json.dumps({"source": str(config), "valid": True, "error_count": 0, "errors": []})
        )
        return
    stdout.print(f"[green]✓[/] {config} is valid: {summary(run_config)}")


def summary(config: RunConfig) -> str:
    algo = config.algorithm
    model = config.model
    if model.hub:
        source = f"hub {model.hub}" + (f"@{model.revision}" if model.revision else "")
    else:
        source = model.path or (
            f"package {model.package}" if model.package else f"builtin:{model.builtin}"
        )
    steps = f"{algo.max_steps} steps" if algo.max_steps else f"{algo.epochs} epoch(s)"
    cluster = config.cluster
    return f"{algo.kind} on {source}, {steps}, {cluster.nnodes} node(s) x {cluster.nproc_per_node} process(es)"
