"""The plugin kinds, in one table: where each finds its built-ins, its entry-point group, and the
Protocol a plugin of that kind satisfies.

Everything a kind points at is a "module:attr" string, imported only when asked for, so listing
kinds (and `rollout plugins list`) imports neither torch nor the harness modules it does not
need. The Protocols live beside the code that calls the plugins (harness/, engines/, runtime/);
this table only points at them.

Entry-point groups are the names plugins were already installed under; they never change, or an
installed package would silently stop being found:

    reward        rollout.rewards        [[rewards]] fn
    environment   rollout.environments   [environment] name
    tool          rollout.tools          [[environment.tools]] name
    scorer        rollout.scorers        [[eval.suites]] scorer
    tracker       rollout.trackers       [logging] trackers
    engine        rollout.engines        [generation] engine

Engines are open like the rest: besides the built-ins (hf, vllm) [generation] engine (and the
--engine of generate, eval and serve) takes an engine plugin, a factory make(spec) -> Engine
(rollout.engines.plugin). A kind may point at a `factory_check`, which finds what it can wrong
with a plugin without calling it (an engine's factory needs a model to be called).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

REWARD_GROUP = "rollout.rewards"
ENVIRONMENT_GROUP = "rollout.environments"
TOOL_GROUP = "rollout.tools"
SCORER_GROUP = "rollout.scorers"
TRACKER_GROUP = "rollout.trackers"
ENGINE_GROUP = "rollout.engines"


@dataclass(frozen=True)
class PluginKind:
    name: str
    group: str | None
    """The entry-point group installed plugins of this kind are found in; None: built-ins only."""
    builtins: str | tuple[str, ...]
    """'module:attr' of the built-ins (or several, merged): a mapping name -> object, a
    collection of names, or a function of no arguments returning either."""
    protocol: str
    """'module:attr' of the Protocol a plugin of this kind satisfies."""
    configured_by: str
    """Where a run config names one."""
    untestable: str | None = None
    """Why `rollout plugins test` cannot run one locally; None when it can."""
    factory_check: str | None = None
    """'module:attr' of a function(plugin) -> list of problems found without calling it; None:
    being callable is all that is checked when the reference is resolved."""

    def load_builtins(self) -> Mapping[str, Any]:
        """The built-ins by name (for a kind that only names them, each maps to None)."""
        sources = (self.builtins,) if isinstance(self.builtins, str) else self.builtins
        merged: dict[str, Any] = {}
        for source in sources:
            found = _load(source)
            if callable(found) and not isinstance(found, Mapping):
                found = found()
            merged.update(found if isinstance(found, Mapping) else dict.fromkeys(found))
        return merged

    def load_protocol(self) -> type:
        return _load(self.protocol)

    def factory_problems(self, plugin: Any) -> list[str]:
        """What `factory_check` finds wrong with a resolved plugin (nothing without one)."""
        return _load(self.factory_check)(plugin) if self.factory_check else []

    def entry_points(self) -> list[importlib.metadata.EntryPoint]:
        """Installed entry points of this kind (none for a kind without a group)."""
        if self.group is None:
            return []
        return sorted(importlib.metadata.entry_points(group=self.group), key=lambda ep: ep.name)


KINDS: dict[str, PluginKind] = {
    kind.name: kind
    for kind in (
        PluginKind(
            "reward",
            REWARD_GROUP,
            "rollout.harness.rewards:BUILTIN_REWARDS",
            "rollout.harness.reward_contract:RewardFn",
            "[[rewards]] fn",
        ),
        PluginKind(
            "environment",
            ENVIRONMENT_GROUP,
            "rollout.harness.environments:plan_builtins",
            "rollout.harness.environments.base:Environment",
            "[environment] name",
        ),
        PluginKind(
            "tool",
            TOOL_GROUP,
            "rollout.harness.tools.builtin:BUILTIN_TOOLS",
            "rollout.harness.tools.plugin:ToolFunction",
            "[[environment.tools]] name",
        ),
        PluginKind(
            "scorer",
            SCORER_GROUP,
            "rollout.harness.eval.scorers:SCORERS",
            "rollout.harness.eval.scorers:ScorerFn",
            "[[eval.suites]] scorer",
        ),
        PluginKind(
            "engine",
            ENGINE_GROUP,
            "rollout.engines.build:ENGINES",
            "rollout.engines.base:Engine",
            "[generation] engine",
            factory_check="rollout.engines.plugin:factory_problems",
        ),
        PluginKind(
            "tracker",
            TRACKER_GROUP,
            # The console tracker is the host's (drawn from the run store), the rest the workers'.
            ("rollout.runtime.trackers:HOST_TRACKERS", "rollout.runtime.trackers:TRACKERS"),
            "rollout.runtime.trackers:Tracker",
            "[logging] trackers",
        ),
    )
}


def kind(name: str) -> PluginKind:
    """The kind called ``name``; KeyError naming the kinds there are."""
    try:
        return KINDS[name]
    except KeyError:
        raise KeyError(f"no plugin kind {name!r}: one of {', '.join(KINDS)}") from None


@dataclass(frozen=True)
class Available:
    """One plugin a config could name: its kind, its name there, where it comes from."""

    kind: str
    name: str
    source: str
    """'builtin', or 'entry point <distribution>'."""
    version: str | None
    target: str
    """What it is: 'module:attr' (for a built-in engine or tracker, only its name)."""


def available(kinds: Iterable[str] | None = None) -> list[Available]:
    """Built-ins and installed entry points of each kind (all kinds when None), without importing
    any plugin: an entry point is read from its distribution's metadata."""
    found: list[Available] = []
    rollout_version = _version("rollout")
    for name in kinds if kinds is not None else KINDS:
        plugin_kind = kind(name)
        for builtin, obj in sorted(plugin_kind.load_builtins().items()):
            found.append(
                Available(name, builtin, "builtin", rollout_version, _target(obj, builtin))
            )
        for ep in plugin_kind.entry_points():
            dist = ep.dist.name if ep.dist else None
            found.append(
                Available(
                    name,
                    ep.name,
                    f"entry point {dist or '(unknown distribution)'}",
                    ep.dist.version if ep.dist else None,
                    ep.value,
                )
            )
    return found


def _target(obj: Any, name: str) -> str:
    if obj is None:
        return name
    module = getattr(obj, "__module__", None) or type(obj).__module__
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}:{qualname}"


def _load(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
