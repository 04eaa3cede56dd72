"""Run reward plugins on a batch: in order, each under a time limit, every result checked.

A reward is called as ``fn(prompts, completions, **fields, **options)`` and returns one float per
completion (see rewards.py). The runner passes a function only the dataset fields it names (all of
them if it takes ``**kwargs``), plus its options, and accepts nothing but one finite number per
completion. Anything else is a RewardError naming the plugin, the sample and the problem: a score
is never broadcast, coerced or replaced, since a silently wrong reward trains the wrong thing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import math
import numbers
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

_QUOTE_CHARS = 60


class RewardError(Exception):
    """A reward plugin failed on a batch. reward: its name; sample: the index, when one is to blame."""

    def __init__(self, message: str, *, reward: str, sample: int | None = None):
        super().__init__(message)
        self.reward = reward
        self.sample = sample


@dataclass(frozen=True)
class RewardFunction:
    """A reward plugin ready to call; build it with ``describe``.

    accepts: the keyword parameters ``fn`` names, or None when it takes ``**kwargs`` (then every
    dataset field is passed to it).
    """

    name: str
    fn: Callable[..., Any]
    weight: float
    options: Mapping[str, Any]
    timeout_s: float
    accepts: frozenset[str] | None


@dataclass(frozen=True)
class RewardScores:
    """total: the weighted sum per completion. per_function: each reward's scores, by name."""

    total: list[float]
    per_function: dict[str, list[float]]


def describe(
    name: str, fn: Callable[..., Any], weight: float, options: Mapping[str, Any], timeout_s: float
) -> RewardFunction:
    """A RewardFunction for ``fn``, its signature read once here rather than on every batch."""
    return RewardFunction(
        name=name,
        fn=fn,
        weight=weight,
        options=MappingProxyType(dict(options)),
        timeout_s=timeout_s,
        accepts=accepted_keywords(fn),
    )


class RewardRunner:
    """Scores batches with a fixed list of reward functions.

    guard: wraps each call of a function (given its name), e.g. to note which plugin the
    process is inside of, so a crash in plugin code can be blamed on the plugin.
    """

    def __init__(
        self,
        functions: Sequence[RewardFunction],
        guard: Callable[[str], AbstractContextManager[None]] | None = None,
    ):
        names = [function.name for function in functions]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"reward names must be unique; repeated: {', '.join(repeated)}")
        self.functions = tuple(functions)
        self._guard = guard or (lambda _name: contextlib.nullcontext())

    def score(
        self, prompts: list[str], completions: list[str], rows: list[Mapping[str, Any]]
    ) -> RewardScores:
        """Every function on the batch, in order; the first failure raises RewardError.

        prompts, completions and rows hold one entry per completion (a prompt sampled G times
        appears G times); rows are the dataset records the prompts came from.
        """
        if not len(prompts) == len(completions) == len(rows):
            raise ValueError(
                f"{len(prompts)} prompts, {len(completions)} completions and {len(rows)} rows: "
                "each needs one entry per completion"
            )
        columns = _columns(rows)
        per_function = {}
        for function in self.functions:
            with self._guard(function.name):
                per_function[function.name] = _run(function, prompts, completions, columns)
        total = [
            math.fsum(
                function.weight * per_function[function.name][i] for function in self.functions
            )
            for i in range(len(completions))
        ]
        return RewardScores(total=total, per_function=per_function)


def _run(
    function: RewardFunction,
    prompts: list[str],
    completions: list[str],
    columns: Mapping[str, list[Any]],
) -> list[float]:
    # Fresh lists for each call, so a plugin that mutates its arguments cannot change what the
    # next one sees. Options win over a data field of the same name: the config is more specific.
    fields = {
        key: list(values)
        for key, values in columns.items()
        if function.accepts is None or key in function.accepts
    }
    kwargs = {**fields, **function.options}
    result = _call(function, list(prompts), list(completions), kwargs)
    return _checked(function.name, result, completions)


def _call(
    function: RewardFunction, prompts: list[str], completions: list[str], kwargs: dict[str, Any]
) -> Any:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def work() -> None:
        try:
            future.set_result(function.fn(prompts, completions, **kwargs))
        except BaseException as exc:  # whatever happens, the waiting side hears of it
            future.set_exception(exc)

    # Python cannot kill a thread: a hung plugin keeps its thread, and the RewardError below stops
    # the run instead. A daemon thread rather than a ThreadPoolExecutor, whose workers are joined
    # at interpreter exit, so that thread cannot also keep the stopped process alive.
    threading.Thread(target=work, name=f"reward-{function.name}", daemon=True).start()
    done, _ = concurrent.futures.wait([future], timeout=function.timeout_s)
    if not done:
        raise RewardError(
            f"reward {function.name!r} did not return within {function.timeout_s:g} s for "
            f"{len(completions)} completions; make it faster or raise its timeout_s",
            reward=function.name,
        )
    error = future.exception()
    if error is not None:
        where = _plugin_frame(error, function.fn)
        at = f" at {where}" if where else ""
        raise RewardError(
            f"reward {function.name!r} raised {type(error).__name__}: {error}{at}",
            reward=function.name,
        ) from error
    return future.result()


def _checked(name: str, result: Any, completions: list[str]) -> list[float]:
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
        return f"{type(value).__name__} {_shorten(repr(value))}" if value is not None else "None"
    if not math.isfinite(value):
        return repr(float(value))
    return None


def accepted_keywords(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The dataset fields a reward is passed: the keyword parameters it names after the first
    two, or None when it takes **kwargs (then every field)."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None  # no signature to read (some C callables): pass every field, let the call say
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    # prompts and completions fill the first two positions; the rest can be filled by keyword.
    return frozenset(
        p.name
        for p in parameters
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p not in positional[:2]
    )


def _columns(rows: list[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """[{field: value}, ...] -> {field: [value, ...]}; every row must have the same fields."""
    if not rows:
        return {}
    fields = set(rows[0])
    for i, row in enumerate(rows):
        if set(row) != fields:
            raise ValueError(f"row {i} has fields {sorted(row)} but row 0 has {sorted(fields)}")
    return {key: [row[key] for row in rows] for key in rows[0]}


def _plugin_frame(error: BaseException, fn: Callable[..., Any]) -> str | None:
    """file:line of the innermost frame in the plugin's own file (not a library it called)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return None
    frames = [
        f for f in traceback.extract_tb(error.__traceback__) if f.filename == code.co_filename
    ]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def _quote(text: str) -> str:
    return repr(_shorten(text))


def _shorten(text: str) -> str:
    return text if len(text) <= _QUOTE_CHARS else text[: _QUOTE_CHARS - 1] + "…"
