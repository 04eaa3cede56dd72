"""What `rollout plugins` does, below the CLI: list the plugins a config could name, try one on a
sample (plugin_trial.py), scaffold a new one (rollout.plugins.scaffold). Kinds and their groups
are rollout.plugins.registry's."""

from __future__ import annotations

from rollout.errors import Issue, RolloutError
from rollout.inference.plugin_trial import Call, Trial, try_plugin
from rollout.plugins.registry import KINDS, Available, available
from rollout.plugins.scaffold import SCAFFOLD_KINDS, write_scaffold

__all__ = [
    "KINDS",
    "SCAFFOLD_KINDS",
    "Available",
    "Call",
    "Trial",
    "list_plugins",
    "try_plugin",
    "write_scaffold",
]


def list_plugins(kind: str | None = None) -> list[Available]:
    """Built-ins and installed entry points, of one kind or all; RolloutError for an unknown kind."""
    if kind is not None and kind not in KINDS:
        raise RolloutError(
            Issue(
                "--kind", f"no plugin kind {kind!r}", value=kind, hint=f"one of: {', '.join(KINDS)}"
            )
        )
    return available([kind] if kind is not None else None)
