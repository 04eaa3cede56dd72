"""Read a config file (TOML, YAML or JSON by extension) and apply ``--set`` overrides."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rollout.config.root import RunConfig
from rollout.config.validate import validate_config
from rollout.errors import ConfigError, Issue

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

SUFFIXES = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> RunConfig:
    """Read, override and validate a config file. Raises ConfigError listing every problem."""
    raw = read_config_file(path)
    raw = apply_overrides(raw, overrides, source=str(path))
    return validate_config(raw, source=str(path))


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    source = str(path)
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise ConfigError(
            Issue(
                source,
                f"unknown config file type {path.suffix!r}",
                hint="use a .toml, .yaml/.yml or .json file",
            ),
            source=source,
        )
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            Issue(source, "no such file", hint=_nearby_files(path)), source=source
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            Issue(source, "is a directory, not a config file"), source=source
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(Issue(source, f"cannot read: {exc}"), source=source) from None
    data = _parse(text, kind, source)
    if not isinstance(data, dict):
        raise ConfigError(
            Issue(source, f"the file must hold a table of sections, not a {type(data).__name__}"),
            source=source,
        )
    return data


def _parse(text: str, kind: str, source: str) -> Any:
    if kind == "toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(_syntax_issue(source, "TOML", str(exc)), source=source) from None
    if kind == "json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            issue = Issue(
                f"{source}:{exc.lineno}:{exc.colno}",
                f"JSON syntax error at line {exc.lineno}, column {exc.colno}: {exc.msg}",
            )
            raise ConfigError(issue, source=source) from None
    import yaml  # only YAML configs pay for the import

    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(
            Issue(where, f"YAML syntax error{at}: {problem}"), source=source
        ) from None


_TOML_POSITION = re.compile(r"\(at line (\d+), column (\d+)\)")


def _syntax_issue(source: str, language: str, message: str) -> Issue:
    match = _TOML_POSITION.search(message)
    if not match:
        return Issue(source, f"{language} syntax error: {message}")
    line, column = match.groups()
    what = _TOML_POSITION.sub("", message).strip()
    return Issue(
        f"{source}:{line}:{column}",
        f"{language} syntax error at line {line}, column {column}: {what}",
    )


def _nearby_files(path: Path) -> str | None:
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        return f"directory {str(parent)!r} does not exist either"
    import difflib

    names = [p.name for p in parent.iterdir() if p.suffix.lower() in SUFFIXES]
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return f"did you mean {str(parent / close[0])!r}?" if close else None


# --- --set a.b.c=VALUE -------------------------------------------------------------------------


def apply_overrides(
    raw: Mapping[str, Any], overrides: Iterable[str], *, source: str | None = None
) -> dict[str, Any]:
    """Return a copy of ``raw`` with each ``dotted.key=VALUE`` applied.

    VALUE is read as a TOML value (``3``, ``1e-5``, ``true``, ``"text"``, ``[1, 2]``,
    ``{ a = 1 }``); anything that is not valid TOML is taken as a plain string, so
    ``--set model.path=./ckpt`` works without quoting; ``null`` unsets an optional key (e.g.
    ``--set data.eval=null``). ``rewards[0].weight=2`` indexes a list.
    """
    result = json.loads(json.dumps(raw))  # deep copy of plain data
    issues = []
    for override in overrides:
        try:
            path, value = _parse_override(override)
            _assign(result, path, value)
        except ValueError as exc:
            issues.append(Issue(f"--set {override}", str(exc)))
    if issues:
        raise ConfigError(issues, source=source)
    return result


_SEGMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_-]*)((?:\[\d+\])*)$")


def _parse_override(override: str) -> tuple[list[str | int], Any]:
    if "=" not in override:
        raise ValueError("expected KEY=VALUE, e.g. --set algorithm.lr=1e-5")
    key, text = override.split("=", 1)
    key = key.strip()
    if not key:
        raise ValueError("the key before '=' is empty")
    path: list[str | int] = []
    for segment in key.split("."):
        match = _SEGMENT.match(segment)
        if not match:
            raise ValueError(
                f"{segment!r} is not a valid key segment (letters, digits, _ and -, "
                "optionally followed by [index])"
            )
        path.append(match.group(1))
        path.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    return path, _parse_value(text.strip())


def _parse_value(text: str) -> Any:
    if text == "null":  # TOML has no null; this is how an override unsets an optional key
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _assign(target: Any, path: list[str | int], value: Any) -> None:
    walked: list[str] = []
    for i, part in enumerate(path):
        last = i == len(path) - 1
        where = ".".join(walked) or "the top level"
        if isinstance(part, int):
            if not isinstance(target, list):
                raise ValueError(f"{where} is not a list, so it cannot be indexed with [{part}]")
            if part >= len(target):
                raise ValueError(f"{where} has {len(target)} items; index {part} is out of range")
            if last:
                target[part] = value
                return
            target = target[part]
            walked[-1] = f"{walked[-1]}[{part}]"
            continue
        if not isinstance(target, dict):
            raise ValueError(f"{where} is a value, not a table, so it has no key {part!r}")
        walked.append(part)
        if last:
            target[part] = value
            return
        target = target.setdefault(part, [] if isinstance(path[i + 1], int) else {})


__all__ = ["RunConfig", "apply_overrides", "load_config", "read_config_file"]
