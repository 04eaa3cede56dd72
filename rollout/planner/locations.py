"""Where a configured input lives: a local path (relative to the config's directory) or an fsspec
URL, and what to tell the user when nothing is there."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout.errors import Issue, PlanError, did_you_mean
from rollout.files import is_url
from rollout.planner.object_stores import failure_issue, quick_filesystem


def resolve(location: str, base_dir: Path) -> str:
    """An absolute local path or the URL unchanged; relative paths start at `base_dir`."""
    if is_url(location):
        return location
    path = Path(location.removeprefix("file://")).expanduser()
    return str(path if path.is_absolute() else (base_dir / path).resolve())


def join(location: str, name: str) -> str:
    return f"{location.rstrip('/')}/{name}" if is_url(location) else os.path.join(location, name)


def exists(location: str, key: str | None = None) -> bool:
    """Whether a file or directory is at `location`; a remote store that cannot answer (no such
    endpoint, credentials refused, no answer in time) is a PlanError naming `key`."""
    if is_url(location):
        return _remote(location, key, lambda fs, path, bounded: fs.exists(path, **bounded))
    return os.path.exists(location)


def is_dir(location: str, key: str | None = None) -> bool:
    if is_url(location):
        return _remote(location, key, lambda fs, path, bounded: fs.isdir(path, **bounded))
    return os.path.isdir(location)


def size(location: str, key: str | None = None) -> int:
    if is_url(location):
        return int(_remote(location, key, lambda fs, path, bounded: fs.size(path, **bounded)))
    return os.path.getsize(location)


def list_files(directory: str, key: str | None = None) -> dict[str, int]:
    """The plain files directly inside `directory`, by name, with their sizes in bytes."""
    if is_url(directory):
        entries = _remote(
            directory, key, lambda fs, path, bounded: fs.ls(path, detail=True, **bounded)
        )
        return {
            entry["name"].rstrip("/").rsplit("/", 1)[-1]: int(entry.get("size") or 0)
            for entry in entries
            if entry.get("type") == "file"
        }
    with os.scandir(directory) as entries:
        return {entry.name: entry.stat().st_size for entry in entries if entry.is_file()}


CONFIG_DIRECTORY = "the config file's directory"


def not_found(
    path: str, location: str, *, what: str, value: Any, relative_to: str = CONFIG_DIRECTORY
) -> Issue:
    """An Issue for a missing local file or URL, suggesting a near name from the same directory.

    relative_to: where the relative paths of `path` start, in words: the config file's directory
    for a config key, the current directory for a command-line option.
    """
    hint = f"relative paths start at {relative_to}"
    if not is_url(location):
        parent, name = os.path.split(location)
        if os.path.isdir(parent):
            hint = did_you_mean(name, sorted(os.listdir(parent)), most=3) or hint
        else:
            hint = f"its directory {parent} does not exist either; {hint}"
    return Issue(path, f"{what} not found: {location}", value=value, hint=hint)


def filesystem_package(url: str) -> str | None:
    """The package fsspec needs for `url`'s scheme when it is not installed ('s3fs' for s3://),
    or None when nothing is missing (or fsspec knows no such scheme: fsspec says so itself)."""
    import importlib.util

    from fsspec.registry import known_implementations

    known = known_implementations.get(url.split("://", 1)[0].lower())
    if known is None:
        return None
    module = known["class"].split(".", 1)[0]
    return None if importlib.util.find_spec(module) is not None else module


def _remote(location: str, key: str | None, call: Callable[[Any, str, dict], Any]) -> Any:
    """`call(filesystem, path, call options)` on the store holding `location`, opened to fail
    fast; its failures (but "not found", which callers word) become one PlanError naming `key`."""
    package = filesystem_package(location)
    if package is not None:
        scheme = location.split("://", 1)[0]
        raise PlanError(
            Issue(
                key or location,
                f"reading {scheme}:// needs the {package} package, which is not installed here",
                value=location,
                hint=f"pip install {package}",
            )
        )
    try:
        fs, path, bounded = quick_filesystem(location)
        return call(fs, path, bounded)
    except FileNotFoundError:
        raise
    except Exception as error:  # classified: unreachable, credentials, access, silence
        issue = failure_issue(error, location, key or location, doing="read", writing=False)
        raise PlanError(issue) from None
