"""A config holds plain data: strings, numbers, booleans, lists and tables (and null, which unsets
an optional key). Anything else is refused here, at its dotted path, before pydantic sees it.

TOML and YAML read an unquoted 2024-01-01 as a date, YAML has !!binary and !!set; none of these
can be written to plan.lock (JSON). An integer past 64 bits means nothing to any setting and
breaks the seeding and tensor code it reaches. A NUL character makes every os function raise.
The shape is bounded too, since the parsers themselves are not: nesting deeper than MAX_DEPTH,
a YAML alias inside its own anchor (a cycle), and more than MAX_VALUES values (a "billion laughs"
YAML, whose aliases expand exponentially) are refused before anything else walks the data.
The walk is iterative and stops at the budget, so it is safe on exactly those inputs.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rollout.errors import Issue

MAX_DEPTH = 64
MAX_VALUES = 100_000
MAX_LISTED = 20
_SHOWN = 6  # path parts shown for a value nested too deeply
INT_BITS = 64
_INT_MAX = 2 ** (INT_BITS - 1) - 1

RawPath = tuple[Any, ...]
"""Keys (for tables) and indices (for lists) from the top of the config to one value."""


@dataclass
class Findings:
    issues: list[Issue] = field(default_factory=list)
    refused: list[RawPath] = field(default_factory=list)
    """Where each refused value is, so that later checks can leave it out."""
    shape: bool = False
    """The shape itself is refused (too deep, cyclic, too big): nothing else may walk the data."""


def check_plain(data: Any) -> Findings:
    """Every value of ``data`` that is not plain config data, with its path; at most MAX_LISTED
    are listed, then a count of the rest."""
    findings = Findings()
    unlisted = 0
    for path, where, message, extra in _walk(data, findings):
        findings.refused.append(path)
        if len(findings.issues) < MAX_LISTED:
            findings.issues.append(Issue(where, message, **extra))
        else:
            unlisted += 1
    if unlisted:
        findings.issues.append(Issue("(config)", f"... and {unlisted} more values like these"))
    return findings


def deeper_than(value: Any, limit: int) -> bool:
    """Whether lists and tables in ``value`` nest more than ``limit`` levels (without recursing:
    the values it is for are those that would exhaust the recursion limit)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= limit:
                return True
            stack.extend((child, depth + 1) for child in _children(item))
    return False


def _children(container: dict[Any, Any] | list[Any]) -> Iterable[Any]:
    return container.values() if isinstance(container, dict) else container


def dotted(path: RawPath) -> str:
    """``('rewards', 0, 'fn')`` -> ``rewards[0].fn``."""
    text = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool) and text:
            text += f"[{part}]"
        else:
            text = f"{text}.{part}" if text else str(part)
    return text or "(top level)"


Found = tuple[RawPath, str, str, dict[str, Any]]
"""A refused value: its raw path, its path as shown, what is wrong, and Issue's other fields."""


def _walk(data: Any, findings: Findings) -> Iterator[Found]:
    # Each entry: the value, its path, and the ids of the tables and lists that hold it.
    stack: list[tuple[Any, RawPath, tuple[int, ...]]] = [(data, (), ())]
    seen = 0
    while stack:
        value, path, holders = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            findings.shape = True
            yield (
                path[:1],
                dotted(path[:1]),
                f"the config holds more than {MAX_VALUES:,} values",
                {
                    "hint": "a config is a few dozen settings; is a YAML alias (*name) expanding "
                    "into copies of copies?"
                },
            )
            return
        if isinstance(value, dict | list | tuple):
            if id(value) in holders:
                findings.shape = True
                yield path, dotted(path), "contains itself (a YAML alias inside its anchor)", {}
                continue
            if len(path) >= MAX_DEPTH:
                findings.shape = True
                # Shown from the top, where the user can find it; the rest is [0][0][0]...
                shown = dotted(path[:_SHOWN]) + "..."
                yield path, shown, f"is nested more than {MAX_DEPTH} levels deep", {}
                continue
            yield from _push_children(value, path, (*holders, id(value)), stack)
            continue
        problem = _value_problem(value)
        if problem is not None:
            yield (path, dotted(path), *problem)


def _push_children(
    value: Any, path: RawPath, holders: tuple[int, ...], stack: list[Any]
) -> Iterator[Found]:
    if not isinstance(value, dict):
        children = [(item, (*path, i)) for i, item in enumerate(value)]
    else:
        children = []
        for key, item in value.items():
            problem = _key_problem(key)
            if problem is not None:
                where = f"{dotted(path)}.{key}" if path else str(key)
                yield ((*path, key), where, *problem)
            else:
                children.append((item, (*path, key)))
    # Reversed onto the stack, so problems are reported in the order they appear in the file.
    stack.extend((item, where, holders) for item, where in reversed(children))


_NOT_PLAIN = "a config value is a string, number, boolean, list or table, not {}"
# Checked in order: a datetime is also a date.
_KINDS: tuple[tuple[type | tuple[type, ...], str, str], ...] = (
    (datetime.datetime, "a date and time", 'put it in quotes: "{}"'),
    (datetime.date, "a date", 'put it in quotes: "{}"'),
    (datetime.time, "a time of day", 'put it in quotes: "{}"'),
    ((bytes, bytearray), "binary data (YAML !!binary)", "write it as a string"),
    ((set, frozenset), "a set (YAML !!set)", "write it as a list: [a, b]"),
)


def _value_problem(value: Any) -> tuple[str, dict[str, Any]] | None:
    if value is None or isinstance(value, bool | float):
        return None
    if isinstance(value, int):
        if value.bit_length() < INT_BITS:
            return None
        # Never str(value) or repr(value) here: both refuse more than 4300 digits.
        return f"is too large: a config integer fits in {INT_BITS} bits (at most {_INT_MAX:,})", {}
    if isinstance(value, str):
        if "\0" in value:
            return "holds a NUL character (\\x00), which no path, name or setting may", {
                "value": value
            }
        return None
    for kinds, _, hint in _KINDS:
        if isinstance(value, kinds):
            text = value.isoformat() if hasattr(value, "isoformat") else ""
            return _NOT_PLAIN.format(_kind_of(value)), {"hint": hint.format(text)}
    return _NOT_PLAIN.format(_kind_of(value)), {}


def _kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    for kinds, name, _ in _KINDS:
        if isinstance(value, kinds):
            return name
    return f"a {type(value).__name__}"


def _key_problem(key: Any) -> tuple[str, dict[str, Any]] | None:
    if isinstance(key, str):
        if "\0" in key:
            return "the key holds a NUL character (\\x00)", {"value": key}
        return None
    return f"a key is text, not {_kind_of(key)}", {"hint": "put the key in quotes"}
