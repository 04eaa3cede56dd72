"""Resolve plugin references to callables, and record who they resolved to (identity.py).

A reference is one of:

    numeric_match              a built-in, else an installed entry point in the group
    my_pkg.rewards:score       a module on the import path, then an attribute path in it
    ./rewards.py:score         a file, relative to the config's directory (or absolute)

Resolving imports the plugin (planning is the place to find out it does not import); checking a
plan for staleness does not (rollout.plugins.identity.plugin_changes). Every failure
is a PlanError with one Issue at the config path that holds the reference, without traceback text.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
import inspect
import re
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any, Literal

from rollout.errors import Issue, PlanError, did_you_mean
from rollout.fingerprints import sha256_bytes
from rollout.plugins.identity import (
    PluginIdentity,
    builtin_identity,
    file_identity,
    module_identity,
)
from rollout.plugins.probe import Probe

_FILE_REF = re.compile(r"^(?P<file>[^:]+\.py):(?P<attr>[A-Za-z_][A-Za-z0-9_.]*)$")
_MODULE_REF = re.compile(r"^(?P<module>[A-Za-z_][\w.]*):(?P<attr>[A-Za-z_][A-Za-z0-9_.]*)$")


@dataclass(frozen=True)
class ResolvedPlugin:
    fn: Callable[..., Any]
    identity: PluginIdentity


def resolve_plugin(
    ref: str,
    *,
    base_dir: Path,
    used_by: str,
    group: str = "rollout.rewards",
    builtins: Mapping[str, Callable[..., Any]],
) -> ResolvedPlugin:
    """Import what ``ref`` names and describe it precisely enough to notice when it changes."""
    if match := _FILE_REF.match(ref):
        return _resolve_file(ref, Path(base_dir), match["file"], match["attr"], used_by)
    if match := _MODULE_REF.match(ref):
        return _resolve_module(ref, match["module"], match["attr"], used_by, kind="module")
    if ref in builtins:
        return _resolve_builtin(ref, builtins[ref], used_by)
    return _resolve_entry_point(ref, group, builtins, used_by)


def load_plugin(identity: PluginIdentity) -> Callable[..., Any]:
    """Import the callable a planned ``identity`` names, without resolving or identifying it again.

    The worker's way back to what the planner resolved: the host has checked that the identity
    still holds (plugin_changes) before launch. A failure is a PlanError at ``identity.used_by``,
    worded as when resolving.
    """
    ref, used_by = identity.ref, identity.used_by
    if identity.kind == "file":
        assert identity.path is not None  # a file plugin's identity always names its file
        match = _FILE_REF.match(ref)
        module = _exec_file(Path(identity.path), ref, used_by)
        label = match["file"] if match else identity.path
    else:
        module = _import_module(identity.module, ref, used_by)
        label = identity.module
    return _get_callable(module, identity.qualname, label=label, ref=ref, used_by=used_by)


def import_probe(
    ref: str,
    *,
    base_dir: Path,
    used_by: str,
    group: str = "rollout.rewards",
    builtins: Mapping[str, Callable[..., Any]],
) -> Probe | None:
    """What importing ``ref`` would import, for rollout.plugins.probe; None for a built-in (our
    own code) or a file that is not there (resolve_plugin says so)."""
    if match := _FILE_REF.match(ref):
        path = (Path(base_dir) / match["file"]).resolve()
        return Probe(used_by, ref, "file", str(path)) if path.is_file() else None
    if match := _MODULE_REF.match(ref):
        return Probe(used_by, ref, "module", match["module"])
    if ref in builtins:
        return None
    return Probe(used_by, ref, "entry_point", ref, group)


# ---------------------------------------------------------------------------------------------
# the four kinds


def _resolve_builtin(ref: str, fn: Callable[..., Any], used_by: str) -> ResolvedPlugin:
    return ResolvedPlugin(fn, builtin_identity(fn, ref=ref, used_by=used_by))


def _resolve_module(
    ref: str,
    module_name: str,
    attr: str,
    used_by: str,
    *,
    kind: Literal["module", "entry_point"],
    distribution: str | None = None,
) -> ResolvedPlugin:
    module = _import_module(module_name, ref, used_by)
    fn = _get_callable(module, attr, label=module_name, ref=ref, used_by=used_by)
    identity = module_identity(
        fn,
        module,
        ref=ref,
        used_by=used_by,
        kind=kind,
        module_name=module_name,
        qualname=attr,
        distribution=distribution,
    )
    return ResolvedPlugin(fn, identity)


def _resolve_entry_point(
    name: str, group: str, builtins: Mapping[str, Callable[..., Any]], used_by: str
) -> ResolvedPlugin:
    found = {ep.value: ep for ep in importlib.metadata.entry_points(group=group, name=name)}
    if not found:
        raise _error(
            used_by,
            ref=name,
            message=f"no built-in and no installed entry point in group {group!r} has this name",
            hint=_unknown_name_hint(name, group, builtins),
        )
    if len(found) > 1:
        owners = ", ".join(sorted(f"{_dist_name(ep)} ({ep.value})" for ep in found.values()))
        raise _error(
            used_by,
            ref=name,
            message=f"several installed distributions provide the entry point {name!r} in group "
            f"{group!r}: {owners}",
            hint="uninstall all but one, or reference the function directly as 'module:function'",
        )
    (entry_point,) = found.values()
    return _resolve_module(
        name,
        entry_point.module,
        entry_point.attr,
        used_by,
        kind="entry_point",
        distribution=_dist_name(entry_point),
    )


def _resolve_file(ref: str, base_dir: Path, file: str, attr: str, used_by: str) -> ResolvedPlugin:
    path = (base_dir / file).resolve()
    if not path.is_file():
        raise _error(
            used_by,
            ref=ref,
            message=f"plugin file {file!r} not found (looked for {path})",
            hint=_nearby_files_hint(file, path),
        )
    module = _exec_file(path, ref, used_by)
    fn = _get_callable(module, attr, label=file, ref=ref, used_by=used_by)
    return ResolvedPlugin(fn, file_identity(fn, path, ref=ref, used_by=used_by, qualname=attr))


# ---------------------------------------------------------------------------------------------
# importing, with every failure turned into one Issue


def _import_module(name: str, ref: str, used_by: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        # Only the module itself (or a parent package) missing is "not found"; a missing
        # dependency of an existing plugin is a failure inside the plugin, reported below.
        if not (exc.name and (name == exc.name or name.startswith(exc.name + "."))):
            raise _import_failure(exc, name, _package_files(name), ref, used_by) from None
        raise _error(
            used_by,
            ref=ref,
            message=f"module {name!r} not found",
            hint="is the package installed in this environment, or its directory on PYTHONPATH?",
        ) from None
    except SyntaxError as exc:
        raise _syntax_error(exc, ref, used_by) from None
    except Exception as exc:
        raise _import_failure(exc, name, _package_files(name), ref, used_by) from None


def _exec_file(path: Path, ref: str, used_by: str) -> ModuleType:
    # A synthetic name unique to this file, so two plugin files both called rewards.py (or one
    # called json.py) never replace each other, or a real module, in sys.modules.
    name = f"_rollout_plugin_{path.stem}_{sha256_bytes(str(path).encode())[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py path always has a source loader
    module = importlib.util.module_from_spec(spec)
    # Registered while it runs, as a normal import would be: dataclasses and pickling look it up.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[name]
        raise _syntax_error(exc, ref, used_by) from None
    except Exception as exc:
        del sys.modules[name]
        raise _import_failure(exc, str(path), lambda f: Path(f) == path, ref, used_by) from None
    return module


def _syntax_error(exc: SyntaxError, ref: str, used_by: str) -> PlanError:
    where = f"{exc.filename}:{exc.lineno}" if exc.lineno else str(exc.filename)
    code = f": {exc.text.strip()}" if exc.text and exc.text.strip() else ""
    return _error(
        used_by,
        ref=ref,
        message=f"syntax error at {where}: {exc.msg}{code}",
        hint="fix the syntax error and plan again",
    )


def _import_failure(
    exc: Exception, what: str, owns: Callable[[str], bool], ref: str, used_by: str
) -> PlanError:
    """An exception the plugin raised while being imported, located in the plugin's own code."""
    where = _last_frame(exc.__traceback__, owns)
    at = f" at {where}" if where else ""
    rerun = f"python {what}" if what.endswith(".py") else f"python -c 'import {what}'"
    return _error(
        used_by,
        ref=ref,
        message=f"importing {what} raised {type(exc).__name__}: {exc}{at}",
        hint=f"run `{rerun}` to see the full traceback",
    )


def _last_frame(tb: TracebackType | None, owns: Callable[[str], bool]) -> str | None:
    """file:line of the innermost frame in the plugin's own code (not a library it called)."""
    frames = [frame for frame in traceback.extract_tb(tb) if owns(frame.filename)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def _package_files(module_name: str) -> Callable[[str], bool]:
    """Which files belong to the top-level package of ``module_name`` (found without importing)."""
    try:
        spec = importlib.util.find_spec(module_name.split(".")[0])
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return lambda filename: False
    roots = [Path(p) for p in spec.submodule_search_locations or []]
    origin = Path(spec.origin) if spec.origin else None
    return lambda filename: (
        Path(filename) == origin or any(Path(filename).is_relative_to(root) for root in roots)
    )


def _get_callable(
    module: ModuleType, attr: str, *, label: str, ref: str, used_by: str
) -> Callable[..., Any]:
    """Follow ``attr`` ("score" or "Scorer.score") from the module; ``label`` names the module."""
    obj: Any = module
    walked: list[str] = []
    for part in attr.split("."):
        if not hasattr(obj, part):
            owner = f"{label}:{'.'.join(walked)}" if walked else label
            choices = _public_callables(obj)
            listing = f"it defines: {', '.join(choices)}" if choices else "it defines no functions"
            raise _error(
                used_by,
                ref=ref,
                message=f"{owner} has no attribute {part!r}",
                hint=did_you_mean(part, choices) or listing,
            )
        obj = getattr(obj, part)
        walked.append(part)
    if not callable(obj):
        raise _error(
            used_by,
            ref=ref,
            message=f"{label}:{attr} is a {type(obj).__name__}, not a function",
            hint="reference a function: fn(prompts, completions, **kwargs) -> list[float]",
        )
    return obj


def _public_callables(obj: Any) -> list[str]:
    # getattr_static: listing must not run lazy module __getattr__ hooks (transformers would
    # import torch) or property getters.
    return sorted(
        name
        for name in dir(obj)
        if not name.startswith("_") and callable(inspect.getattr_static(obj, name, None))
    )


# ---------------------------------------------------------------------------------------------
# hints for references that name nothing


def _unknown_name_hint(name: str, group: str, builtins: Mapping[str, Callable[..., Any]]) -> str:
    entry_points = sorted({ep.name for ep in importlib.metadata.entry_points(group=group)})
    known = f"built-ins: {', '.join(sorted(builtins)) or 'none'}"
    known += f"; entry points: {', '.join(entry_points) or 'none installed'}"
    guess = did_you_mean(name, [*builtins, *entry_points])
    usage = "or write 'package.module:function' or './file.py:function'"
    return f"{guess} {known}; {usage}" if guess else f"{known}; {usage}"


def _nearby_files_hint(file: str, path: Path) -> str:
    if not path.parent.is_dir():
        return (
            f"the directory {path.parent} does not exist; relative paths start at the config "
            "file's directory"
        )
    candidates = sorted(p.name for p in path.parent.glob("*.py"))
    guess = difflib.get_close_matches(path.name, candidates, n=1, cutoff=0.6)
    if guess:
        written_dir, slash, _ = file.rpartition("/")
        return f"did you mean {written_dir + slash + guess[0]!r}?"
    if candidates:
        return f".py files in {path.parent}: {', '.join(candidates)}"
    return f"there are no .py files in {path.parent}"


def _error(used_by: str, *, ref: str, message: str, hint: str) -> PlanError:
    return PlanError(Issue(used_by, message, value=ref, hint=hint))


# ---------------------------------------------------------------------------------------------
# entry points


def _dist_name(entry_point: importlib.metadata.EntryPoint) -> str | None:
    return entry_point.dist.name if entry_point.dist else None
