"""Cross-field rules still run on a config area when some of its fields are bad.

validate.py leaves the bad fields out (`without`), validates the rest of the area again (the
left-out fields take their defaults) and hands it to the rules wrapped by `guarded`: reading a
left-out field raises rules.FieldNotValid, which stops that one rule. So a rule broken by the good
fields is reported in the same run as the bad fields, and no rule judges a default the user never
wrote (a bad num_generations must not bring "rollout batch 10 is not divisible by 4" with it).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

from rollout.config.plain import RawPath
from rollout.config.rules import FieldNotValid


def without(data: Any, paths: Iterable[RawPath]) -> tuple[Any, list[RawPath]]:
    """A copy of ``data`` with the value at each path taken out, and the paths taken out.

    An item is never taken out of a list, which would renumber the items after it: the key of
    the nearest table above it goes instead. A path that does not lead to a value (a missing
    key) or has no table key on the way (an item of a top-level list) takes nothing out.
    """
    data = copy.deepcopy(data)
    removed: list[RawPath] = []
    for path in paths:
        cut = _last_key(data, path)
        if cut is None:
            continue
        parent = data
        for part in path[:cut]:
            parent = parent[part]
        del parent[path[cut]]
        removed.append(tuple(path[: cut + 1]))
    return data, removed


def _last_key(data: Any, path: RawPath) -> int | None:
    """Index in ``path`` of the last table key on the way to its value; None when there is none
    or the path does not lead to a value (taken out already with a table above it)."""
    node, cut = data, None
    for i, part in enumerate(path):
        if isinstance(node, dict) and part in node:
            cut = i
        elif not (isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)):
            return None
        node = node[part]
    return cut


def salvage(validate: Callable[[Any], Any], value: Any, bad: list[RawPath]) -> Any | None:
    """``value`` validated without its ``bad`` paths and guarded against reading them; None when
    what is left still does not validate (a required field was among the bad ones)."""
    cleaned, removed = without(value, bad)
    try:
        validated = validate(cleaned)
    except ValidationError:
        return None
    return guarded(validated, [*bad, *removed])


def guarded(value: Any, bad: list[RawPath]) -> Any:
    """``value`` (a model, or a list of them) such that reading a ``bad`` path raises
    FieldNotValid; the value itself when nothing in it is bad."""
    if not bad:
        return value
    if () in bad:
        return _Guarded(None, [()])
    if isinstance(value, BaseModel):
        return _Guarded(value, bad)
    if isinstance(value, list):
        by_index: dict[int, list[RawPath]] = defaultdict(list)
        for path in bad:
            by_index[path[0]].append(path[1:])
        return [guarded(item, by_index.get(i, [])) for i, item in enumerate(value)]
    return _Guarded(None, [()])


class _Guarded:
    """A validated model whose left-out fields cannot be read. Properties run against the guard
    itself, so a property that reads a left-out field (RewardSpec.metric_name) stops too."""

    def __init__(self, model: BaseModel | None, bad: list[RawPath]):
        self._model = model
        self._whole = () in bad
        self._left_out: set[str] = set()
        self._nested: dict[str, list[RawPath]] = defaultdict(list)
        for path in filter(None, bad):
            head, rest = path[0], path[1:]
            inner = getattr(model, str(head), None)
            if rest and isinstance(inner, BaseModel | list):
                self._nested[head].append(rest)
            else:
                self._left_out.add(head)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # our own attributes, before __init__ has set them
            raise AttributeError(name)
        if self._whole or name in self._left_out:
            raise FieldNotValid(name)
        attribute = getattr(type(self._model), name, None)
        if isinstance(attribute, property):
            return attribute.fget(self)  # type: ignore[misc]
        value = getattr(self._model, name)
        return guarded(value, self._nested[name]) if name in self._nested else value
