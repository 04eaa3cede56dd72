"""Plan-time checks of [logging] trackers: a tracker whose package is missing is refused now, with
the pip command that installs it, not discovered by a worker after the model has loaded.

Only whether the package is installed is checked (importlib's find_spec imports nothing), so
planning stays fast and torch-free.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import rollout.tracing as tracing
from rollout.config.root import RunConfig
from rollout.errors import Issue


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
