"""The reward call convention, in one place: what a reward function is given, what it returns.

A reward is called as ``fn(prompts, completions, **fields, **options)`` and returns one float per
completion (see rewards.py for the built-ins). ``prompts`` and ``completions`` fill its first two
positional parameters; ``fields`` are the dataset fields (and mapped roles) it names as keyword
parameters after those two, every one of them when it takes ``**kwargs``, each a list with one
entry per completion; ``options`` are the reward's options from the config, passed on every call
and winning over a field of the same name (the config is more specific). Each call has
``timeout_s`` seconds. What comes back must be one finite number per completion: a score is
never broadcast, coerced or replaced, since a silently wrong reward trains the wrong thing.

The planner checks each function against this call before step 1 (check_reward_signature); the
runner (reward_runner.py) makes exactly this call in the worker (call_keywords, checked_scores).

A reward that executes model-written code declares it with the attribute ``runs_model_code =
True`` (see ``runs_model_code``). The plan then tries this host's sandbox (refusing, unless
``rewards[i].allow_unsandboxed``), and the worker passes its decision as the keyword
``require_network_isolation`` (SANDBOX_KEYWORD), which such a reward must accept and its options
may not set.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, Protocol

from rollout.errors import Issue, did_you_mean

_QUOTE_CHARS = 60

SANDBOX_KEYWORD = "require_network_isolation"
"""What the worker passes a reward that runs model-written code: the plan's sandbox decision."""


class RewardFn(Protocol):
    """A reward plugin: what ``[[rewards]] fn`` names (the call this module describes)."""

    def __call__(self, prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        """One finite float per completion; kwargs: the dataset fields it names (lists, one entry
        per completion) and its options."""
        ...


def runs_model_code(fn: Callable[..., Any]) -> bool:
    """Whether a reward declares that it executes model-written code (``fn.runs_model_code``)."""
    return getattr(fn, "runs_model_code", False) is True


class RewardError(Exception):
    """A reward plugin failed on a batch. reward: its name; sample: the index, when one is to blame."""

    def __init__(self, message: str, *, reward: str, sample: int | None = None):
        super().__init__(message)
        self.reward = reward
        self.sample = sample


OnError = Literal["stop", "fail_sample"]
"""rewards[i].on_error: what a sample its sidecar hangs, crashes or raises on costs."""


@dataclass(frozen=True)
class RewardFunction:
    """A reward plugin ready to call; build it with ``describe``.

    accepts: the keyword parameters ``fn`` names, or None when it takes ``**kwargs`` (then every
    dataset field is passed to it). on_error: what a sample a sidecar fails on costs ("stop":
    the step; "fail_sample": that sample, scored ``failure_score``); see reward_runner.
    """

    name: str
    fn: Callable[..., Any]
    weight: float
    options: Mapping[str, Any]
    timeout_s: float
    accepts: frozenset[str] | None
    on_error: OnError = "stop"
    failure_score: float = 0.0


def describe(
    name: str,
    fn: Callable[..., Any],
    weight: float,
    options: Mapping[str, Any],
    timeout_s: float,
    *,
    on_error: OnError = "stop",
    failure_score: float = 0.0,
) -> RewardFunction:
    """A RewardFunction for ``fn``, its signature read once here rather than on every batch."""
    return RewardFunction(
        name=name,
        fn=fn,
        weight=weight,
        options=MappingProxyType(dict(options)),
        timeout_s=timeout_s,
        accepts=accepted_keywords(fn),
        on_error=on_error,
        failure_score=failure_score,
    )


# ---------------------------------------------------------------------------------------------
# the call and its result


def accepted_keywords(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The dataset fields a reward is passed: the keyword parameters it names after the first
    two, or None when it takes **kwargs (then every field)."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None  # no signature to read (some C callables): pass every field, let the call say
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(_keyword_parameters(parameters))


def _positional(parameters: list[inspect.Parameter]) -> list[inspect.Parameter]:
    return [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _keyword_parameters(parameters: list[inspect.Parameter]) -> dict[str, inspect.Parameter]:
    """The parameters a keyword (a field or an option) can fill: every one after the first two
    positions (which prompts and completions fill) that can be passed by keyword."""
    slots = _positional(parameters)[:2]
    return {
        p.name: p
        for p in parameters
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p not in slots
    }


def call_keywords(
    accepts: frozenset[str] | None, fields: Mapping[str, Any], options: Mapping[str, Any]
) -> dict[str, Any]:
    """The keyword arguments of a reward call: the fields it accepts (``accepts`` None: every one),
    then every option, which wins over a field of the same name."""
    passed = {key: value for key, value in fields.items() if accepts is None or key in accepts}
    return {**passed, **options}


def checked_scores(name: str, result: Any, completions: list[str]) -> list[float]:
    """``result`` as floats, if it is one finite number per completion; else a RewardError."""
    if isinstance(result, (str, bytes)) or not isinstance(result, Sequence):
        raise RewardError(
            f"reward {name!r} returned {type(result).__name__}, not a list: return a list with "
            "one float per completion",
            reward=name,
        )
    if len(result) != len(completions):
        raise RewardError(
            f"reward {name!r} returned {len(result)} values for {len(completions)} completions: "
            "return one float per completion",
            reward=name,
        )
    for i, (value, completion) in enumerate(zip(result, completions, strict=True)):
        problem = _not_a_score(value)
        if problem:
            raise RewardError(
                f"reward {name!r} returned {problem} for sample {i} (completion "
                f"{_quote(completion)}): every score must be a finite number",
                reward=name,
                sample=i,
            )
    return [float(value) for value in result]


def _not_a_score(value: Any) -> str | None:
    """What is wrong with ``value`` as a score, or None if nothing is."""
    # bool is a number to Python, but True as a reward is more likely a mistake than a 1.0.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return (
            f"{type(value).__name__} {_shorten(repr(value), _QUOTE_CHARS)}"
            if value is not None
            else "None"
        )
    if not math.isfinite(value):
        return repr(float(value))
    return None


def _quote(text: str) -> str:
    return repr(_shorten(text, _QUOTE_CHARS))


# ---------------------------------------------------------------------------------------------
# checking a reward's signature against the call the run makes


def check_reward_signature(
    fn: Callable[..., Any],
    *,
    options: Mapping[str, Any],
    fields: set[str],
    used_by: str,
    ref: str | None = None,
    eval_fields: set[str] | None = None,
) -> list[Issue]:
    """Problems with the call the run makes: ``fn(prompts, completions, **passed, **options)``.

    The call rollout.harness.reward_runner makes: ``passed`` holds the record fields (and mapped
    roles) that ``fn`` names as parameters after its first two, or every field when it takes
    ``**kwargs``; every option is passed. fields: the training data's; eval_fields: the evaluation
    data's, if there is any (its completions are scored too). ref: the reference as written.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []  # nothing to check against; a bad call then fails at the first step
    call = _RewardCall(fn, signature, used_by, ref)
    if not call.takes_two_positional():
        return [
            call.issue(
                used_by,
                f"{call.name}{signature} cannot be called with two positional arguments",
                hint="a reward takes (prompts, completions, **kwargs) and returns one float per "
                "completion",
            )
        ]
    splits = {"the data": fields}
    if eval_fields is not None:
        splits["the eval data"] = eval_fields
    issues = [call.unknown_option(key, options) for key in options if call.rejects(key)]
    for parameter in call.required():
        lacking = [data for data, found in splits.items() if parameter not in found]
        if parameter not in options and lacking:
            issues.append(call.unsatisfied(parameter, splits[lacking[0]], data=lacking[0]))
    if issues:
        return issues
    for data, found in splits.items():
        problem = call.twice(options, found, data) or call.unbound(options, found)
        if problem is not None:
            return [problem]
    return []


class _RewardCall:
    """A reward function's parameters, seen from the call rollout.harness.reward_runner makes."""

    def __init__(
        self, fn: Callable[..., Any], signature: inspect.Signature, used_by: str, ref: str | None
    ):
        self.signature = signature
        self.name = getattr(fn, "__name__", used_by)
        self.used_by = used_by
        self.prefix = used_by.rpartition(".")[0] or used_by
        self.ref = ref
        self.parameters = list(signature.parameters.values())
        self.positional = _positional(self.parameters)
        # prompts and completions fill the first two positions (or *args).
        self.slots = self.positional[:2]
        # Parameters after those that a keyword (an option or a field) can fill.
        self.keywords = _keyword_parameters(self.parameters)
        self.takes_any = any(p.kind is p.VAR_KEYWORD for p in self.parameters)
        self.accepts = None if self.takes_any else frozenset(self.keywords)

    def takes_two_positional(self) -> bool:
        """prompts and completions fit, and no other parameter must be given positionally."""
        if len(self.positional) < 2 and not any(
            p.kind is p.VAR_POSITIONAL for p in self.parameters
        ):
            return False
        return not any(
            p.kind is p.POSITIONAL_ONLY and p.default is p.empty for p in self.positional[2:]
        )

    def rejects(self, key: str) -> bool:
        """An option the function has no keyword parameter for (a slot's name is not one)."""
        return key not in self.keywords and not self.takes_any and key not in self._slot_names()

    def required(self) -> list[str]:
        return [p.name for p in self.keywords.values() if p.default is p.empty]

    def passed(self, options: Mapping[str, Any], fields: set[str]) -> dict[str, Any]:
        """The keyword arguments of the call: fields (as the lists they are) and options."""
        return call_keywords(self.accepts, dict.fromkeys(sorted(fields), _PER_COMPLETION), options)

    def text(self, options: Mapping[str, Any], fields: set[str]) -> str:
        """The call as it will be made: score(prompts, completions, answer=[...], scale=2)."""
        arguments = ["prompts", "completions"]
        arguments += [f"{key}={value!r}" for key, value in self.passed(options, fields).items()]
        return _shorten(f"{self.name}({', '.join(arguments)})", 300)

    def twice(self, options: Mapping[str, Any], fields: set[str], data: str) -> Issue | None:
        """A parameter that takes prompts or completions and is also given by keyword."""
        for slot, role in zip(self.slots, ("prompts", "completions"), strict=False):
            if slot.kind is not slot.POSITIONAL_OR_KEYWORD:
                continue
            if slot.name in options:
                source, fix = f"the option {slot.name!r}", "rename the option, or "
            elif self.takes_any and slot.name in fields:
                source, fix = f"the field {slot.name!r} of {data}", ""
            else:
                continue
            names = ", ".join(p.name for p in self.slots)
            return self.issue(
                self.used_by,
                f"{self.name}{self.signature} cannot take the call the run makes, "
                f"{self.text(options, fields)}: {slot.name!r} would get two values, the "
                f"{role} by position and {source} by keyword",
                hint=f"{fix}make the first two parameters positional-only "
                f"({self.name}({names}, /, ...)) or name them prompts and completions",
            )
        return None

    def unbound(self, options: Mapping[str, Any], fields: set[str]) -> Issue | None:
        """Any other way the call would fail, as Python itself would report it."""
        try:
            self.signature.bind(_PER_COMPLETION, _PER_COMPLETION, **self.passed(options, fields))
        except TypeError as exc:
            return self.issue(
                self.used_by,
                f"{self.name}{self.signature} cannot take the call the run makes, "
                f"{self.text(options, fields)}: {exc}",
                hint="a reward takes (prompts, completions, **kwargs): add **kwargs, or a "
                "parameter for each keyword of the call",
            )
        return None

    def unknown_option(self, key: str, options: Mapping[str, Any]) -> Issue:
        accepted = ", ".join(self.keywords) or "none"
        return Issue(
            f"{self.prefix}.options.{key}",
            f"{self.name}{self.signature} has no parameter {key!r}, and the run passes the "
            f"option as {key}={_shorten(repr(options[key]), 60)}",
            hint=did_you_mean(key, self.keywords)
            or f"the parameters it accepts: {accepted}; add a parameter {key!r} or **kwargs to "
            f"{self.name}, or remove the option",
        )

    def unsatisfied(self, parameter: str, fields: set[str], *, data: str) -> Issue:
        present = ", ".join(sorted(fields)) or "none"
        return self.issue(
            self.used_by,
            f"{self.name}() requires {parameter!r}, which is neither an option nor a field of "
            f"{data}",
            hint=f"set {self.prefix}.options.{parameter}, or use data with a {parameter!r} field "
            f"({data} has: {present})",
        )

    def issue(self, path: str, message: str, *, hint: str) -> Issue:
        if self.ref is None:
            return Issue(path, message, hint=hint)
        return Issue(path, message, value=self.ref, hint=hint)

    def _slot_names(self) -> set[str]:
        return {p.name for p in self.slots if p.kind is p.POSITIONAL_OR_KEYWORD}


class _PerCompletion:
    """Stands for a list with one value per completion, in a call's description."""

    def __repr__(self) -> str:
        return "[...]"


_PER_COMPLETION = _PerCompletion()


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
