"""Run reward plugins on a batch: in order, each under a time limit, every result checked.

Each function is called as reward_contract.py says (the one statement of the reward call
convention, which the planner checks signatures against): given only the dataset fields it names
(all of them if it takes ``**kwargs``), plus its options, and accepting nothing but one finite
number per completion. Anything else is a RewardError naming the plugin, the sample and the
problem.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from rollout.harness.deadline import Overran, Raised, call_with_deadline
from rollout.harness.reward_contract import (
    RewardError,
    RewardFunction,
    call_keywords,
    checked_scores,
)


@dataclass(frozen=True)
class RewardScores:
    """total: the weighted sum per completion. per_function: each reward's scores, by name."""

    total: list[float]
    per_function: dict[str, list[float]]


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
    # next one sees.
    fields = {key: list(values) for key, values in columns.items()}
    kwargs = call_keywords(function.accepts, fields, function.options)
    result = _call(function, list(prompts), list(completions), kwargs)
    return checked_scores(function.name, result, completions)


def _call(
    function: RewardFunction, prompts: list[str], completions: list[str], kwargs: dict[str, Any]
) -> Any:
    if getattr(function.fn, "enforces_deadline", False):
        return _call_sidecar(function, prompts, completions, kwargs)
    # A hung plugin keeps its thread (see rollout.harness.deadline); the RewardError stops the run.
    try:
        return call_with_deadline(
            lambda: function.fn(prompts, completions, **kwargs),
            function.timeout_s,
            name=f"reward-{function.name}",
        )
    except Overran:
        raise RewardError(
            f"reward {function.name!r} did not return within {function.timeout_s:g} s for "
            f"{len(completions)} completions; make it faster or raise its timeout_s",
            reward=function.name,
        ) from None
    except Raised as raised:
        error = raised.error
        where = _plugin_frame(error, function.fn)
        at = f" at {where}" if where else ""
        raise RewardError(
            f"reward {function.name!r} raised {type(error).__name__}: {error}{at}",
            reward=function.name,
        ) from error


def _call_sidecar(
    function: RewardFunction, prompts: list[str], completions: list[str], kwargs: dict[str, Any]
) -> Any:
    """A function that keeps its own deadline (a sidecar: rollout.plugins.sidecar.host kills a
    hung child and resubmits the batch once); called here directly, since a thread of its own
    would only add a second, shorter clock. Its errors already name the plugin and the batch."""
    try:
        return function.fn(prompts, completions, **kwargs)
    except Exception as error:
        raise RewardError(f"reward {function.name!r}: {error}", reward=function.name) from error


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
