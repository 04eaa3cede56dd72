"""Read a config file (TOML, YAML or JSON by extension) and apply ``--set`` overrides.

Whatever the file holds, reading it ends in data or in a ConfigError, never a traceback or a
hang: only a regular file is read, at most MAX_CONFIG_BYTES of it (rollout/files.py), and what the
parsers themselves cannot take (nesting past the recursion limit, an integer past Python's digit
limit, an impossible YAML date) becomes an Issue at its line.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rollout.config.plain import MAX_DEPTH, check_plain
from rollout.config.root import RunConfig
from rollout.config.validate import validate_config
from rollout.errors import ConfigError, Issue
from rollout.files import FileRefused, FileTooLarge, read_capped

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

SUFFIXES = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}

# A config is a few KiB; this is far past any real one, and still parses in seconds.
MAX_CONFIG_BYTES = 1 << 20


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> RunConfig:
    """Read, override and validate a config file. Raises ConfigError listing every problem."""
    # validate_config checks the values, so their problems are listed with every other problem.
    raw = read_config_file(path, check_values=False)
    raw = apply_overrides(raw, overrides, source=str(path))
    return validate_config(raw, source=str(path))


def read_config_file(path: str | Path, *, check_values: bool = True) -> dict[str, Any]:
    """The file's table of sections. Its shape is always checked (depth, size, cycles); its values
    (no dates, no NUL, 64-bit integers: config/plain.py) too unless ``check_values`` is False."""
    source = str(path)
    if "\0" in source:
        raise ConfigError(
            Issue(repr(source), "the config path holds a NUL character (\\x00)"), source=None
        )
    path = Path(path)
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
        text = read_capped(path, limit=MAX_CONFIG_BYTES, what="a config file").decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(
            Issue(source, "no such file", hint=_nearby_files(path)), source=source
        ) from None
    except FileTooLarge as exc:
        hint = "a config holds settings; data goes in its own file, named by data.train.path"
        raise ConfigError(Issue(source, exc.reason, hint=hint), source=source) from None
    except FileRefused as exc:
        hint = "pass the path of a .toml, .yaml or .json file"
        raise ConfigError(Issue(source, exc.reason, hint=hint), source=source) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(Issue(source, f"cannot read: {exc}"), source=source) from None
    data = _parse(text, kind, source)
    if not isinstance(data, dict):
        raise ConfigError(
            Issue(source, f"the file must hold a table of sections, not a {type(data).__name__}"),
            source=source,
        )
    plain = check_plain(data)
    if plain.shape or (check_values and plain.issues):
        raise ConfigError(plain.issues, source=source)
    return data


def _parse(text: str, kind: str, source: str) -> Any:
    language = kind.upper()
    try:
        if kind == "toml":
            return tomllib.loads(text)
        if kind == "json":
            return json.loads(text)
        return _parse_yaml(text)
    except RecursionError:
        where, at = _position(text, _too_deep(text), source)
        message = f"{language} is nested too deeply{at}: a config nests at most {MAX_DEPTH} levels"
        raise ConfigError(Issue(where, message), source=source) from None
    except ValueError as exc:
        raise ConfigError(_parse_issue(exc, text, language, source), source=source) from None


def _parse_issue(exc: ValueError, text: str, language: str, source: str) -> Issue:
    if isinstance(exc, json.JSONDecodeError):
        return Issue(
            f"{source}:{exc.lineno}:{exc.colno}",
            f"{language} syntax error at line {exc.lineno}, column {exc.colno}: {exc.msg}",
        )
    if _DIGIT_LIMIT_TEXT in str(exc):
        match = _LONG_NUMBER.search(text)
        where, at = _position(text, match.start() if match else None, source)
        return Issue(
            where,
            f"{language} holds a number with more than {_DIGIT_LIMIT} digits{at}",
            hint=f"a config integer fits in 64 bits (at most {2**63 - 1:,})",
        )
    return _syntax_issue(source, language, str(exc))


_DIGIT_LIMIT = getattr(sys, "get_int_max_str_digits", lambda: 4300)() or 4300
_DIGIT_LIMIT_TEXT = "Exceeds the limit"  # CPython's message for an int past the digit limit
_LONG_NUMBER = re.compile(rf"[0-9][0-9_]{{{_DIGIT_LIMIT},}}")


def _too_deep(text: str) -> int | None:
    """Offset of the first bracket nested deeper than MAX_DEPTH (quotes not considered: it only
    points the user at a place), or None."""
    depth = 0
    for offset, char in enumerate(text):
        if char in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return offset
        elif char in "]}":
            depth -= 1
    return None


def _position(text: str, offset: int | None, source: str) -> tuple[str, str]:
    """(issue path, " at line L, column C") for an offset in ``text``; the bare source if None."""
    if offset is None:
        return source, ""
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return f"{source}:{line}:{column}", f" at line {line}, column {column}"


def _parse_yaml(text: str) -> Any:
    import yaml  # only YAML configs pay for the import

    try:
        return yaml.load(text, Loader=_yaml_loader()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        at = f" (at line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ValueError(f"{problem}{at}") from None


@functools.cache
def _yaml_loader() -> type:
    """yaml.SafeLoader, with two changes for configs."""
    import yaml

    class ConfigLoader(yaml.SafeLoader):
        def construct_object(self, node: Any, deep: bool = False) -> Any:
            # A value the constructor cannot build (a date like 2024-13-45) is reported at its
            # line; an integer past the digit limit goes on as ValueError, for its own message.
            try:
                return super().construct_object(node, deep)
            except ValueError as exc:
                if _DIGIT_LIMIT_TEXT in str(exc):
                    raise
                shown = node.value if isinstance(node.value, str) else node.tag
                raise yaml.constructor.ConstructorError(
                    None, None, f"cannot read {shown[:80]!r}: {exc}", node.start_mark
                ) from None

    # YAML 1.1 reads 1e-5 (no dot) as a string, which strict validation would then refuse as
    # "not a number"; YAML 1.2, TOML and JSON all read it as a number, and so do we.
    ConfigLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )
    return ConfigLoader


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
    ``--set model.path=./ckpt`` works without quoting, and so does a date (``2024-01-01`` is
    the text typed); ``null`` unsets a key: None where the key takes None (``--set
    data.eval=null``), else its default (``--set cluster.device=null``: validate_config leaves
    out a null its field refuses).
    ``rewards[0].weight=2`` indexes a list. The values are checked with the rest of the config
    by validate_config.
    """
    plain = check_plain(dict(raw))
    if plain.shape:  # too deep or cyclic for the copy below
        raise ConfigError(plain.issues, source=source)
    result = copy.deepcopy(dict(raw))
    issues = []
    for override in overrides:
        try:
            path, value = _parse_override(override)
            _assign(result, path, value)
        except ValueError as exc:
            issues.append(Issue(_label(override), str(exc)))
    if issues:
        raise ConfigError(issues, source=source)
    return result


def _label(override: str, limit: int = 100) -> str:
    shown = override if len(override) <= limit else override[: limit - 3] + "..."
    return f"--set {shown}"


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
    if text == "null":  # TOML has no null; this is how an override unsets a key
        return None
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:
        raise ValueError(
            f"the value is nested too deeply: a config nests at most {MAX_DEPTH} levels"
        ) from None
    except ValueError:  # only an integer past the digit limit gets past TOMLDecodeError
        raise ValueError(
            f"the value holds a number with more than {_DIGIT_LIMIT} digits; a config integer "
            f"fits in 64 bits (at most {2**63 - 1:,})"
        ) from None
    if isinstance(value, datetime.date | datetime.time):
        return text  # valid TOML, but on a command line a date is text, as typed
    return value


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
