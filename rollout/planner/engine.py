"""[generation] engine as an engine plugin: resolved at plan time (its import probed in a child
first, as every plugin's), its factory checked as far as it can be without a model, and its
identity recorded in plan.lock so that an edit makes the plan stale.

`resolve_engine_ref` is the same resolution for the commands that take --engine without a plan
(generate, eval, serve, plugins test).
"""

from __future__ import annotations

from pathlib import Path

from rollout.config.generation import BUILTIN_ENGINES, is_plugin_engine
from rollout.config.root import RunConfig
from rollout.errors import Issue, PlanError
from rollout.plugins.identity import PluginIdentity
from rollout.plugins.resolve import ResolvedPlugin

USED_BY = "generation.engine"


def resolve_engine(config: RunConfig, base: Path, issues: list[Issue]) -> PluginIdentity | None:
    """The identity [generation] engine resolved to when it is a plugin (None for a built-in);
    a problem is added to `issues`. Offline runs generate nothing: their engine is not resolved
    (a rule refuses a plugin engine there)."""
    from rollout.plugins.probe import probe_imports
    from rollout.plugins.registry import ENGINE_GROUP
    from rollout.plugins.resolve import import_probe

    ref = config.generation.engine
    if not is_plugin_engine(ref):
        return None
    where = {"base_dir": base, "group": ENGINE_GROUP, "builtins": dict.fromkeys(BUILTIN_ENGINES)}
    probe = import_probe(ref, used_by=USED_BY, **where)
    failed = probe_imports([probe] if probe is not None else [])
    if USED_BY in failed:
        issues.append(failed[USED_BY])
        return None
    try:
        return resolve_engine_ref(ref, base_dir=base, used_by=USED_BY).identity
    except PlanError as error:
        issues.extend(error.issues)
        return None


def resolve_engine_ref(ref: str, *, base_dir: Path, used_by: str) -> ResolvedPlugin:
    """Import an engine plugin reference (a built-in's name is no plugin) and check its factory:
    the factory and its identity, or a PlanError at `used_by`."""
    from rollout.plugins.registry import ENGINE_GROUP, kind
    from rollout.plugins.resolve import resolve_plugin

    builtins = dict.fromkeys(BUILTIN_ENGINES)
    resolved = resolve_plugin(
        ref, base_dir=base_dir, used_by=used_by, group=ENGINE_GROUP, builtins=builtins
    )
    engine_kind = kind("engine")
    problems = engine_kind.factory_problems(resolved.fn)
    if problems:
        raise PlanError(
            Issue(
                used_by,
                f"{ref!r} is not an engine factory: {'; '.join(problems)}",
                value=ref,
                hint="an engine plugin is make(spec) returning an object with generate(prompts, "
                "params), load_weights(weights, version), close() and the properties "
                "policy_version and stats (see docs/plugins.md)",
            )
        )
    return resolved
