"""Turn a raw config mapping into a RunConfig, or into every problem it has at once.

Three checks, whose problems are reported together:
1. Plain data (plain.py): a value that is no string, number, boolean, list or table (a TOML date,
   a YAML !!set), or that later code cannot take (a NUL, an integer past 64 bits), is refused at
   its path and left out of the other checks.
2. Each top-level area is validated on its own, so a typo in [storage] does not hide a bad value in
   [algorithm], and strictly: a value of the wrong type is refused, never converted ("20" is not
   20). Validating in pydantic's JSON mode keeps what every config file needs: an integer is a
   number, and a list fills a fixed-length tuple (adam_betas), as JSON has no tuples and does
   not tell 1 from 1.0.
3. The cross-field rules run on every area, those with bad fields too (partial.py): the area is
   validated again without them, and a rule that reads one stops instead of judging a default.
Pydantic's errors become Issues in translate.py.
"""

from __future__ import annotations

import functools
import json
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from rollout.config.partial import guarded, salvage, without
from rollout.config.plain import RawPath, check_plain
from rollout.config.root import RunConfig
from rollout.config.rules import run_rules
from rollout.config.translate import translate, translate_errors, unknown_key
from rollout.errors import ConfigError, Issue

_ADAPTERS: dict[str, TypeAdapter[Any]] = {}


def validate_config(raw: Mapping[str, Any], *, source: str | None = None) -> RunConfig:
    """Validate a raw mapping (as read from TOML/YAML/JSON). Raises ConfigError with all issues."""
    if not isinstance(raw, Mapping):
        raise ConfigError(
            [Issue("(top level)", "a config must be a table of sections", value=raw)], source=source
        )
    plain = check_plain(dict(raw))
    if plain.shape:  # too deep, cyclic or too big: nothing below may walk it
        raise ConfigError(plain.issues, source=source)
    issues = list(plain.issues)
    cleaned, left_out = without(dict(raw), plain.refused)
    areas: dict[str, Any] = {}
    fields = RunConfig.model_fields
    for key in cleaned:
        if key not in fields:
            issues.append(unknown_key(str(key), list(fields), prefix=""))
    for name, info in fields.items():
        refused = [path[1:] for path in left_out if path[0] == name]
        if name in cleaned and cleaned[name] is None and not info.is_required():
            del cleaned[name]  # a section set to null is unset: its defaults
        if name not in cleaned:
            if info.is_required() and not refused:
                issues.append(
                    Issue(name, f"missing required section [{name}]", hint=_describe(info))
                )
            continue
        cleaned[name] = _unset_refused_nulls(name, info, cleaned[name])
        area, found = _validate_area(name, info, cleaned[name], refused)
        issues.extend(found)
        if area is not None:
            areas[name] = area
    if not issues:
        config = RunConfig.model_validate(cleaned)
        issues.extend(run_rules(config, available=set(fields)))
    else:
        partial = RunConfig.model_construct(**areas)
        issues.extend(run_rules(partial, available=set(areas)))
    if issues:
        raise ConfigError(issues, source=source)
    return config


def _validate_area(
    name: str, info: FieldInfo, value: Any, refused: list[RawPath]
) -> tuple[Any | None, list[Issue]]:
    """The area for the rules (guarded where some of its values are bad; None when it cannot be
    had at all), and its issues."""
    validate = functools.partial(_strictly, _adapter(name, info))
    try:
        return guarded(validate(value), refused), []
    except ValidationError as exc:
        found = translate(exc, prefix=(name,), root=info.annotation)
    # A required key left out for its bad value is reported already: "missing" would be its echo.
    found = [f for f in found if not (f.missing and _under(f.raw_path, refused))]
    bad = [*refused, *(f.raw_path for f in found)]
    return salvage(validate, value, bad), [f.issue for f in found]


def _unset_refused_nulls(name: str, info: FieldInfo, value: Any) -> Any:
    """``value`` without the table keys set to null that their field refuses: null unsets a key,
    so it gets its default back (``--set cluster.device=null`` is "auto" again). A key whose
    field takes None (max_grad_norm = null: no clipping) keeps it; a required key left out is
    then reported missing."""
    if not _holds_null(value):  # the usual case: nothing to unset, no second validation
        return value
    try:
        _strictly(_adapter(name, info), value)
        return value
    except ValidationError as exc:
        found = translate(exc, prefix=(name,), root=info.annotation)
    nulls = [f.raw_path for f in found if not f.missing and _table_key_is_null(value, f.raw_path)]
    return without(value, nulls)[0] if nulls else value


def _holds_null(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_holds_null(v) for v in value.values())
    if isinstance(value, list):
        return any(_holds_null(v) for v in value)
    return value is None


def _table_key_is_null(value: Any, path: RawPath) -> bool:
    """Whether ``path`` ends at a table key whose value is null (not a list item)."""
    if not path or not isinstance(path[-1], str):
        return False
    node = value
    for part in path[:-1]:
        inside = node if isinstance(node, dict) else dict(enumerate(node or []))
        if isinstance(node, str) or part not in inside:
            return False
        node = inside[part]
    return isinstance(node, dict) and path[-1] in node and node[path[-1]] is None


def _strictly(adapter: TypeAdapter[Any], value: Any) -> Any:
    return adapter.validate_json(json.dumps(value), strict=True)


def _under(path: RawPath, prefixes: list[RawPath]) -> bool:
    return any(path[: len(prefix)] == prefix for prefix in prefixes)


def _adapter(name: str, info: FieldInfo) -> TypeAdapter[Any]:
    if name not in _ADAPTERS:
        annotation = info.annotation
        if info.discriminator:
            annotation = typing.Annotated[annotation, info]
        _ADAPTERS[name] = TypeAdapter(annotation)
    return _ADAPTERS[name]


def _describe(info: FieldInfo) -> str | None:
    return f"add it: {info.description}" if info.description else None


__all__ = ["translate_errors", "validate_config"]
