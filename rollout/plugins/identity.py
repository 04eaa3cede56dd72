"""Who a plugin reference resolved to, and whether that has changed since.

A PluginIdentity is recorded in the plan when a reference is resolved (rollout.plugins.resolve),
precisely enough to notice a change later: a distribution's version, or the bytes of the source
file where no version can stand for them (plugin files, modules outside any installed
distribution, editable installs). Checking for changes never imports the plugin: versions come
from package metadata, files are compared by sha256.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout.errors import Issue
from rollout.fingerprints import sha256_file, short_hash

VersionLookup = Callable[[str], str | None]


class PluginIdentity(BaseModel):
    """Who a plugin reference resolved to, precisely enough to notice when it changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    used_by: str = Field(description="Config path that references it, e.g. 'rewards[0].fn'.")
    ref: str = Field(description="The reference as written in the config.")
    kind: Literal["builtin", "module", "file", "entry_point"]
    module: str = Field(description="Module name (or, for file plugins, the file's module name).")
    qualname: str = Field(description="Attribute path of the callable inside the module.")
    path: str | None = Field(default=None, description="Absolute source file, when known.")
    sha256: str | None = Field(
        default=None,
        description="sha256 of the source file: file plugins, modules outside any "
        "installed distribution, and editable installs (whose version stays put while code changes).",
    )
    distribution: str | None = Field(default=None, description="Installed distribution name.")
    version: str | None = Field(default=None, description="Installed distribution version.")
    signature: str = Field(description="The callable's signature, as inspect renders it.")


# ---------------------------------------------------------------------------------------------
# identifying what a reference resolved to


def builtin_identity(fn: Callable[..., Any], *, ref: str, used_by: str) -> PluginIdentity:
    """One of rollout's own functions: rollout's version stands for its code."""
    return PluginIdentity(
        used_by=used_by,
        ref=ref,
        kind="builtin",
        module=fn.__module__,
        qualname=fn.__qualname__,
        path=_source_file(fn, sys.modules[fn.__module__]),
        distribution="rollout",
        version=installed_version("rollout"),
        signature=_signature_text(fn),
    )


def module_identity(
    fn: Callable[..., Any],
    module: ModuleType,
    *,
    ref: str,
    used_by: str,
    kind: Literal["module", "entry_point"],
    module_name: str,
    qualname: str,
    distribution: str | None = None,
) -> PluginIdentity:
    """A function in an importable module; ``distribution``: the one that provides it, if known."""
    path = _source_file(fn, module)
    distribution = distribution or _distribution_of(module_name)
    # Outside any distribution there is no version to compare, and an editable install keeps
    # its version while its code changes: the source file's bytes stand in.
    by_content = distribution is None or _is_editable(distribution)
    return PluginIdentity(
        used_by=used_by,
        ref=ref,
        kind=kind,
        module=module_name,
        qualname=qualname,
        path=path,
        sha256=sha256_file(path) if by_content and path else None,
        distribution=distribution,
        version=installed_version(distribution) if distribution else None,
        signature=_signature_text(fn),
    )


def file_identity(
    fn: Callable[..., Any], path: Path, *, ref: str, used_by: str, qualname: str
) -> PluginIdentity:
    """A function in a plugin file (``./rewards.py:score``): the file's bytes stand for it."""
    return PluginIdentity(
        used_by=used_by,
        ref=ref,
        kind="file",
        module=path.stem,
        qualname=qualname,
        path=str(path),
        sha256=sha256_file(path),
        signature=_signature_text(fn),
    )


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _distribution_of(module_name: str) -> str | None:
    """The one installed distribution that provides this top-level package, if exactly one does.

    Several (a namespace package such as ``google``) leave the version ambiguous; the module is
    then fingerprinted by its file like a module outside any distribution.
    """
    owners = set(importlib.metadata.packages_distributions().get(module_name.split(".")[0], []))
    return owners.pop() if len(owners) == 1 else None


def _is_editable(distribution: str) -> bool:
    """Installed with ``pip install -e`` (PEP 660 records it in direct_url.json)."""
    try:
        text = importlib.metadata.distribution(distribution).read_text("direct_url.json")
        return bool(text and json.loads(text).get("dir_info", {}).get("editable"))
    except (importlib.metadata.PackageNotFoundError, ValueError, AttributeError):
        return False


def _source_file(fn: Callable[..., Any], module: ModuleType) -> str | None:
    # The function's own file when it is re-exported from elsewhere; the module's otherwise
    # (callable instances, functools.partial and C functions have no source file of their own).
    try:
        found = inspect.getsourcefile(inspect.unwrap(fn))
    except TypeError:
        found = None
    found = found or getattr(module, "__file__", None)
    return str(Path(found).resolve()) if found else None


def _signature_text(fn: Callable[..., Any]) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):  # some C callables carry no signature
        return "(...)"


# ---------------------------------------------------------------------------------------------
# freshness: has what a plan resolved changed since? (never imports the plugin)


def plugin_changes(
    identity: PluginIdentity, *, version_of: VersionLookup = installed_version
) -> list[Issue]:
    """What changed since planning: the distribution's version, or the source file's bytes."""
    changes = []
    if identity.distribution:
        now = version_of(identity.distribution)
        if now is None:
            changes.append(
                f"{identity.distribution} is no longer installed (was {identity.version})"
            )
        elif now != identity.version:
            changes.append(f"{identity.distribution} {identity.version} → {now}")
    if identity.sha256 and identity.path:
        changes.extend(_file_changes(Path(identity.path), identity.sha256))
    return [Issue(identity.used_by, change) for change in changes]


def _file_changes(path: Path, planned: str) -> list[str]:
    if not path.is_file():
        return [f"file {path} no longer exists"]
    now = sha256_file(path)
    if now == planned:
        return []
    return [f"{path} changed since planning (sha256 {short_hash(planned)} → {short_hash(now)})"]
