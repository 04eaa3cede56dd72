"""Pydantic's errors, translated into Issues a user can act on.

Each error gets a clean dotted path (the discriminator tag dropped), the bad value, and a fix:
"did you mean" for misspelled keys and choices (with the names other tools use for them), and for
a value of the wrong type, the type expected and the type given ("must be a number, not a
string"), with how to write it. Each issue also records where the bad value sits in the raw config
(`Translated.raw_path`), so validation can leave it out and still run the cross-field rules.
"""

from __future__ import annotations

import difflib
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from rollout.config.plain import RawPath
from rollout.config.secrets import check_secret_ref, redact
from rollout.errors import Issue, did_you_mean


@dataclass(frozen=True)
class Translated:
    issue: Issue
    raw_path: RawPath
    """Where the error is in the validated value: keys and indices, no discriminator tags."""
    missing: bool
    """The error is a required key that is absent (there is no bad value to leave out)."""


def translate_errors(exc: ValidationError, *, prefix: tuple[str, ...], root: Any) -> list[Issue]:
    return [found.issue for found in translate(exc, prefix=prefix, root=root)]


def translate(exc: ValidationError, *, prefix: tuple[str, ...], root: Any) -> list[Translated]:
    found = []
    literals: dict[str, str] = {}
    """path -> the choices of a literal that refused the value there."""
    for error in exc.errors(include_url=False):
        path, raw_path, parent, leaf = _walk(root, tuple(error["loc"]), prefix)
        issue = _issue_for(error, path, parent)
        if issue.has_value and isinstance(issue.value, str) and _is_secret(leaf, issue.value):
            issue = replace(
                issue, value=redact(issue.value) if "://" in issue.value else "<redacted>"
            )
        missing = error["type"] == "missing"
        if error["type"] == "union_tag_not_found":  # the tag is the missing key
            raw_path += (str(error.get("ctx", {}).get("discriminator", "kind")).strip("'"),)
            missing = True
        found.append(Translated(issue, raw_path, missing=missing))
        if error["type"] == "literal_error":
            literals[issue.path] = str(error.get("ctx", {}).get("expected", ""))
    return _one_per_union(found, literals)


def _list_member_said_more(entry: Translated, found: list[Translated]) -> bool:
    """A list given to `str | list[str]` fails the str member ("not a list") and the list member
    at its items: the items' errors say what to change."""
    path = entry.issue.path
    return ", not a list" in entry.issue.message and any(
        other.issue.path.startswith(f"{path}[") for other in found
    )


def _one_per_union(found: list[Translated], literals: dict[str, str]) -> list[Translated]:
    """One issue per field: a value that fits no member of a union such as `'auto' | bool` fails
    each member at the same path. The member that is not a literal says what the value should
    be; the literal's choices are added to it."""
    kept: dict[str, Translated] = {}
    for entry in found:
        path = entry.issue.path
        first = kept.get(path)
        if first is None or (path in literals and first.issue.message.startswith("expected one")):
            kept[path] = entry
    result = []
    for entry in found:
        if kept.get(entry.issue.path) is not entry or _list_member_said_more(entry, found):
            continue
        path = entry.issue.path
        several = sum(f.issue.path == path for f in found) > 1
        if path in literals and several and not entry.issue.message.startswith("expected one"):
            message = f"{entry.issue.message} (or one of {literals[path]})"
            entry = replace(entry, issue=replace(entry.issue, message=message))
        result.append(entry)
    return result


def _is_secret(annotation: Any, value: str) -> bool:
    """A value rejected by a secret field is never echoed back; nor is a URL's password."""
    if redact(value) != value:
        return True
    for arg in get_args(annotation) or ():
        for meta in getattr(arg, "__metadata__", ()) or get_args(arg)[1:]:
            if getattr(meta, "func", None) is check_secret_ref:
                return True
    return any(
        getattr(m, "func", None) is check_secret_ref
        for m in getattr(annotation, "__metadata__", ())
    )


def _issue_for(error: Mapping[str, Any], path: str, parent: Any) -> Issue:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    if kind == "extra_forbidden":
        key = path.rsplit(".", 1)[-1]
        parent_path = path[: -len(key) - 1] if "." in path else ""
        return unknown_key(key, _field_names(parent), prefix=parent_path, value=value)
    if kind == "missing":
        return Issue(path, "missing required key")
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tags = list(_discriminated_members(_strip_optional(parent)) or {})
        discriminator = str(ctx.get("discriminator", "kind")).strip("'")
        tag_path = f"{path}.{discriminator}"
        if kind == "union_tag_not_found":
            misspelled = _misspelling_of(discriminator, value)
            if misspelled:
                return unknown_key(misspelled, [discriminator], prefix=path)
            return Issue(tag_path, f"missing required key; choose one of {_join(tags)}")
        return Issue(
            tag_path,
            f"unknown {discriminator}; expected one of {_join(tags)}",
            value=ctx.get("tag"),
            hint=did_you_mean_choice(str(ctx.get("tag")), tags),
        )
    if kind == "literal_error":
        choices = _split_choices(ctx.get("expected", ""))
        return Issue(
            path,
            f"expected one of {_join(choices)}",
            value=value,
            hint=did_you_mean_choice(str(value), choices),
        )
    if kind in _EXPECTED:
        return Issue(
            path,
            f"must be {_EXPECTED[kind]}, not {_kind_of(value)}",
            value=value,
            hint=_type_hint(kind, value),
        )
    return Issue(path, _message(kind, error["msg"], ctx), value=value)


# What each type error expected, in the words of a config file.
_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a table",
    "model_type": "a table (a [section] or { key = value })",
    "model_attributes_type": "a table (a [section] or { key = value })",
}
_NUMERIC = ("int_type", "int_parsing", "int_from_float", "float_type", "float_parsing")


def _kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "a table"
    return f"a {type(value).__name__}"


def _type_hint(kind: str, value: Any) -> str | None:
    """How to write ``value`` as the type expected, when the user's intent is plain."""
    if kind in _NUMERIC and isinstance(value, str) and _is_number(value, whole=kind[0] == "i"):
        return f"write it without quotes: {value.strip()}"
    if kind.startswith("int") and isinstance(value, float) and value.is_integer():
        return f"write it without a decimal point: {int(value)}"
    if kind.startswith("bool") and isinstance(value, str) and value.lower() in ("true", "false"):
        return f"write it without quotes: {value.lower()}"
    if kind == "string_type" and isinstance(value, bool | int | float):
        text = str(value).lower() if isinstance(value, bool) else repr(value)
        return f'put it in quotes: "{text}"'
    if kind in ("list_type", "tuple_type") and isinstance(value, str | int | float | bool):
        return f"write it as a list: [{json.dumps(value)}]"
    return None


def _is_number(text: str, *, whole: bool) -> bool:
    try:
        number = int(text) if whole else float(text)
    except ValueError:
        return False
    return math.isfinite(number)  # "nan" parses, but is no better unquoted


_MESSAGES = {
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
    "string_too_short": "must be at least {min_length} characters long",
    "string_too_long": "must be at most {max_length} characters long",
    "string_pattern_mismatch": "must match the pattern {pattern}",
    "too_short": "must have at least {min_length} items",
    "too_long": "must have at most {max_length} items",
    "frozen_instance": "cannot be changed",
    "finite_number": "must be a finite number",
}


def _message(kind: str, default: str, ctx: Mapping[str, Any]) -> str:
    if kind == "value_error":
        return default.removeprefix("Value error, ")
    template = _MESSAGES.get(kind)
    if template is None:
        return default[:1].lower() + default[1:]
    try:
        return template.format(**ctx)
    except (KeyError, IndexError):
        return default


# Names other tools use for our keys; a user coming from TRL or verl gets pointed at ours.
_SYNONYMS = {
    "learning_rate": "lr",
    "num_train_epochs": "epochs",
    "ppo_epochs": "update_epochs",
    "per_device_train_batch_size": "micro_batch_size",
    "train_batch_size": "batch_size",
    "max_completion_length": "max_new_tokens",
    "max_tokens": "max_new_tokens",
    "max_prompt_length": "max_prompt_tokens",
    "group_size": "num_generations",
    "n_samples": "num_generations",
    "epsilon": "clip_ratio_low",
    "epsilon_high": "clip_ratio_high",
    "cliprange": "clip_ratio_low",
    "kl_beta": "kl_coef",
    "init_kl_coef": "kl_coef",
    "save_steps": "interval",
    "save_total_limit": "keep_last",
    "model_name_or_path": "path",
    "seed_value": "seed",
}


def unknown_key(key: str, known: list[str], *, prefix: str, value: Any = None) -> Issue:
    path = f"{prefix}.{key}" if prefix else key
    where = f"[{prefix}]" if prefix else "the top level"
    aliases = {alias: target for alias, target in _SYNONYMS.items() if target in known}
    close = difflib.get_close_matches(key.lower(), [*known, *aliases], n=1, cutoff=0.6)
    hint = (
        f"did you mean {aliases.get(close[0], close[0])!r}?"
        if close
        else did_you_mean_choice(key, known)
    )
    if hint is None and known:
        hint = f"known keys in {where}: {', '.join(known)}"
    return Issue(path, f"unknown key in {where}", hint=hint)


def _misspelling_of(key: str, table: Any) -> str | None:
    """The key in ``table`` that looks like a misspelled ``key``, if any."""
    if not isinstance(table, Mapping):
        return None
    close = difflib.get_close_matches(key, [str(k) for k in table], n=1, cutoff=0.6)
    return close[0] if close else None


# Words people use for our choices. Spelling alone would point "gpu" at 'cpu', the opposite of
# what was meant; a synonym is checked before spelling.
_CHOICE_SYNONYMS = {
    "gpu": "cuda",
    "gpus": "cuda",
    "nvidia": "cuda",
    "fp32": "float32",
    "f32": "float32",
    "full": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "huggingface": "hf",
    "transformers": "hf",
    "postgresql": "postgres",
    "pg": "postgres",
    "sqlite3": "sqlite",
    "tb": "tensorboard",
    "weights_and_biases": "wandb",
    "warn": "warning",
    "reinforce++": "reinforce_pp",
    "reward_model": "rm",
}


def did_you_mean_choice(word: str, choices: list[str]) -> str | None:
    """'did you mean X?' for a word that is none of `choices`: a synonym first, then spelling."""
    synonym = _CHOICE_SYNONYMS.get(word.strip().lower())
    if synonym in choices:
        return f"did you mean {synonym!r}?"
    hint = did_you_mean(word, choices)
    lowered = {c.lower(): c for c in choices}
    if hint is None and word.lower() in lowered:  # a case slip too short for difflib to see
        hint = f"did you mean {lowered[word.lower()]!r}?"
    return hint


def _split_choices(text: str) -> list[str]:
    return [
        part.strip().strip("'\"") for part in text.replace(" or ", ",").split(",") if part.strip()
    ]


def _join(choices: list[str]) -> str:
    return ", ".join(repr(c) for c in choices)


# ---------------------------------------------------------------------------------------------
# walking the type tree alongside an error location


def _walk(
    annotation: Any, loc: tuple[Any, ...], prefix: tuple[str, ...]
) -> tuple[str, RawPath, Any, Any]:
    """Follow ``loc`` through ``annotation``; return (dotted path, the keys and indices the user
    wrote, type holding the last key, type of the last key)."""
    path = ".".join(prefix)
    raw: list[Any] = []
    current = annotation
    parent = annotation
    for part in loc:
        if part == "[key]":  # pydantic's marker for "the dict key itself was invalid"
            continue
        current = _strip_optional(current)
        parent = current
        union_members = _discriminated_members(current)
        if union_members is not None:
            # pydantic puts the chosen tag in the location: it is not a key the user wrote.
            current = union_members.get(part, current)
            continue
        member = _union_member(current, part)
        if member is not None:  # likewise the member of a plain union ('bool', "literal['auto']")
            current = member
            continue
        raw.append(part)
        if isinstance(part, int):
            path += f"[{part}]"
            current = _item_type(current)
            continue
        path = f"{path}.{part}" if path else str(part)
        current = _child_type(current, str(part))
    return path, tuple(raw), parent, current


def _strip_optional(annotation: Any) -> Any:
    origin = get_origin(annotation)
    if origin is typing.Annotated:
        return _strip_optional(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _strip_optional(members[0])
    return annotation


def _union_member(annotation: Any, tag: Any) -> Any:
    """The member of a union of scalars (or lists of them) that pydantic names `tag` in an error
    location: 'bool', 'str', 'list[str]', "literal['auto']"; None when `tag` names none."""
    if get_origin(annotation) not in (Union, types.UnionType) or not isinstance(tag, str):
        return None
    for member in get_args(annotation):
        if get_origin(member) is Literal:
            if tag.startswith("literal["):
                return member
        elif tag == getattr(member, "__name__", None) or tag == repr(member):
            return member
    return None


def _discriminated_members(annotation: Any) -> dict[str, Any] | None:
    if get_origin(annotation) not in (Union, types.UnionType):
        return None
    members: dict[str, Any] = {}
    for member in get_args(annotation):
        if (
            isinstance(member, type)
            and issubclass(member, BaseModel)
            and "kind" in member.model_fields
        ):
            for tag in get_args(member.model_fields["kind"].annotation):
                members[tag] = member
    return members or None


def _child_type(annotation: Any, key: str) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        info = annotation.model_fields.get(key)
        return info.annotation if info else None
    if get_origin(annotation) is dict:
        return get_args(annotation)[1]
    return None


def _item_type(annotation: Any) -> Any:
    args = get_args(annotation)
    if get_origin(annotation) in (list, tuple) and args:
        return args[0]
    return None


def _field_names(annotation: Any) -> list[str]:
    annotation = _strip_optional(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    if get_origin(annotation) is dict:
        key_type = get_args(annotation)[0]
        if get_origin(key_type) is Literal:
            return [str(a) for a in get_args(key_type)]
    return []
