"""Plan-time checks of [logging] trackers: a tracker whose package is missing is refused now, with
the pip command that installs it, not discovered by a worker after the model has loaded.

Only whether the package is installed is checked (importlib's find_spec imports nothing), so
planning stays fast and torch-free.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import rollout.tracing as tracing
from rollout.config.logging import BUILTIN_TRACKERS
from rollout.config.root import RunConfig
from rollout.errors import Issue, PlanError
from rollout.plugins.identity import PluginIdentity


@dataclass(frozen=True)
class TrackerPackage:
    module: str  # what the worker imports
    extra: str  # the rollout extra that installs it


TRACKER_PACKAGES: dict[str, TrackerPackage] = {
    "tensorboard": TrackerPackage("tensorboardX", "tensorboard"),
    "wandb": TrackerPackage("wandb", "wandb"),
    "mlflow": TrackerPackage("mlflow", "mlflow"),
}
"""Trackers that need a third-party package; console and jsonl need none."""


def tracker_issues(config: RunConfig) -> list[Issue]:
    """One issue per enabled tracker whose package is not installed here, and one for an
    otlp_endpoint without OpenTelemetry."""
    issues = []
    if config.logging.otlp_endpoint is not None:
        missing = tracing.missing_package()
        if missing is not None:
            issues.append(
                Issue(
                    "logging.otlp_endpoint",
                    f"exporting traces needs the Python package {missing!r}, which is not "
                    "installed in this environment",
                    value=config.logging.otlp_endpoint,
                    hint=f"{tracing.INSTALL_HINT}, or remove otlp_endpoint",
                )
            )
    for tracker in config.logging.trackers:
        package = TRACKER_PACKAGES.get(tracker)
        if package is None or importlib.util.find_spec(package.module) is not None:
            continue
        issues.append(
            Issue(
                "logging.trackers",
                f"the {tracker} tracker needs the Python package {package.module!r}, which is "
                "not installed in this environment",
                value=tracker,
                hint=f"pip install 'rollout[{package.extra}]', or remove \"{tracker}\" from "
                "logging.trackers",
            )
        )
    return issues


def resolve_trackers(config: RunConfig, base: Path, issues: list[Issue]) -> list[PluginIdentity]:
    """Each tracker plugin of [logging] trackers imported once here (in a child first, so one
    that hangs on import is named rather than waited on), and checked to be callable: the
    worker calls it as factory(run_id=..., run_dir=...)."""
    from rollout.plugins.probe import probe_imports
    from rollout.plugins.registry import TRACKER_GROUP
    from rollout.plugins.resolve import import_probe, resolve_plugin

    plugins = [
        (f"logging.trackers[{i}]", ref)
        for i, ref in enumerate(config.logging.trackers)
        if ref not in BUILTIN_TRACKERS
    ]
    # The built-ins are listed in the hint for a name that is none of them or an entry point.
    where = {"base_dir": base, "group": TRACKER_GROUP, "builtins": dict.fromkeys(BUILTIN_TRACKERS)}
    probes = [import_probe(ref, used_by=path, **where) for path, ref in plugins]
    failed = probe_imports([probe for probe in probes if probe is not None])
    identities = []
    for path, ref in plugins:
        if path in failed:
            issues.append(failed[path])
            continue
        try:
            resolved = resolve_plugin(ref, used_by=path, **where)
        except PlanError as error:
            issues.extend(error.issues)
            continue
        identities.append(resolved.identity)
    return identities
