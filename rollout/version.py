"""The installed rollout's version, read once from the package metadata (pyproject.toml is the one
place it is written). A leaf: the planner stamps it into every plan, the CLI prints it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def _version() -> str:
    try:
        return version("rollout")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0.0.0+unknown"


__version__ = _version()
