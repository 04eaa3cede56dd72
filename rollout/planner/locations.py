"""Where a configured input lives: a local path (relative to the config's directory) or an fsspec
URL, and what to tell the user when nothing is there."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rollout.errors import Issue, PlanError, did_you_mean
from rollout.files import is_url


def resolve(location: str, base_dir: Path) -> str:
    """An absolute local path or the URL unchanged; relative paths start at `base_dir`."""
    if is_url(location):
        return location
    path = Path(location.removeprefix("file://")).expanduser()
    return str(path if path.is_absolute() else (base_dir / path).resolve())


def join(location: str, name: str) -> str:
    return f"{location.rstrip('/')}/{name}" if is_url(location) else os.path.join(location, name)


def exists(location: str) -> bool:
    if is_url(location):
        fs, path = _filesystem(location)
        return fs.exists(path)
    return os.path.exists(location)


def is_dir(location: str) -> bool:
    if is_url(location):
        fs, path = _filesystem(location)
        return fs.isdir(path)
    return os.path.isdir(location)


def size(location: str) -> int:
    if is_url(location):
        fs, path = _filesystem(location)
        return int(fs.size(path))
    return os.path.getsize(location)


def list_files(directory: str) -> dict[str, int]:
    """The plain files directly inside `directory`, by name, with their sizes in bytes."""
    if is_url(directory):
        fs, path = _filesystem(directory)
        return {
            entry["name"].rstrip("/").rsplit("/", 1)[-1]: int(entry.get("size") or 0)
            for entry in fs.ls(path, detail=True)
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


def _filesystem(url: str) -> tuple[Any, str]:
    import fsspec  # only remote locations pay for fsspec

    package = filesystem_package(url)
    if package is not None:
        scheme = url.split("://", 1)[0]
        raise PlanError(
            Issue(
                url,
                f"reading {scheme}:// needs the {package} package, which is not installed here",
                hint=f"pip install {package}",
            )
        )
    return fsspec.core.url_to_fs(url)
