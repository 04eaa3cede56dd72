"""Run reward plugins on a batch: in order, each under a time limit, every result checked.

Each function is called as reward_contract.py says (the one statement of the reward call
convention, which the planner checks signatures against): given only the dataset fields it names
(all of them if it takes ``**kwargs``), plus its options, and accepting nothing but one finite
number per completion. Anything else is a RewardError naming the plugin, the sample and the
problem.

A function in a sidecar that fails on a batch (hangs or crashes twice, or raises) is asked
again on halves of the batch until the samples it fails on alone are found (rollout.harness.
isolate). Then its on_error decides: "stop" raises a RewardError naming the sample; "fail_sample"
scores those samples failure_score, records why in RewardScores.failed, and the others keep the
scores their halves got.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from rollout.harness.deadline import Overran, Raised, call_with_deadline
from rollout.harness.isolate import isolate, isolation_budget_s
from rollout.harness.reward_contract import (
    RewardError,
    RewardFunction,
    call_keywords,
    checked_scores,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardScores:
    """total: the weighted sum per completion. per_function: each reward's scores, by name.
    failed: for a reward with on_error = "fail_sample", the samples it failed on (index: why),
    scored its failure_score; empty when nothing failed."""

    total: list[float]
    per_function: dict[str, list[float]]
    failed: dict[str, dict[int, str]] = field(default_factory=dict)


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
        per_function, failed = {}, {}
        for function in self.functions:
            with self._guard(function.name):
                if _isolatable(function):
                    scores, lost = _run_sidecar(function, prompts, completions, columns, rows)
                    failed.update({function.name: lost} if lost else {})
                else:
                    scores = _run(function, prompts, completions, columns)
                per_function[function.name] = scores
        total = [
            math.fsum(
                function.weight * per_function[function.name][i] for function in self.functions
            )
            for i in range(len(completions))
        ]
        return RewardScores(total=total, per_function=per_function, failed=failed)


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


def _isolatable(function: RewardFunction) -> bool:
    """A sidecar's function: it can be killed, so a batch it fails on can be bisected."""
    return getattr(function.fn, "enforces_deadline", False) and hasattr(function.fn, "once")


def _run_sidecar(
    function: RewardFunction,
    prompts: list[str],
    completions: list[str],
    columns: Mapping[str, list[Any]],
    rows: list[Mapping[str, Any]],
) -> tuple[list[float], dict[int, str]]:
    """The scores of a sidecar's function and the samples it failed on (index: why), found by
    bisection when the whole batch fails; with on_error = "stop" a failing sample is raised."""
    n = len(completions)

    def attempt(indices: Sequence[int]) -> Any:
        fields = {key: [values[i] for i in indices] for key, values in columns.items()}
        kwargs = call_keywords(function.accepts, fields, function.options)
        args = ([prompts[i] for i in indices], [completions[i] for i in indices])
        return function.fn.once(args, kwargs, what=_samples_text(indices, n))  # type: ignore[attr-defined]

    fields = {key: list(values) for key, values in columns.items()}
    kwargs = call_keywords(function.accepts, fields, function.options)
    try:
        result = function.fn(list(prompts), list(completions), **kwargs)
    except Exception as error:  # a hang or crash (twice), a raise, arguments JSON cannot carry
        first_cause = str(error)
    else:
        return checked_scores(function.name, result, completions), {}
    found = isolate(
        n,
        attempt,
        first_cause=first_cause,
        budget_s=isolation_budget_s(function.timeout_s, n),
        stop_at_first=function.on_error == "stop",
    )
    # Failing every sample of a batch is the function's fault, not the samples': stop then too.
    broken = n > 1 and len(found.failed) == n
    if found.failed and (function.on_error == "stop" or broken):
        culprit = min(found.failed)
        raise RewardError(
            f"reward {function.name!r} failed on sample {culprit} of {n} "
            f"({_identify(prompts[culprit], rows[culprit])}): {found.failed[culprit]}"
            + (f" (and on each of the other {n - 1} alone)" if broken else ""),
            reward=function.name,
            sample=culprit,
        )
    if not found.failed:  # every half answered: the failure did not come back
        log.warning(
            "reward %r failed on a batch of %d (%s) but answered for every part of it on its "
            "own; those scores are used",
            function.name,
            n,
            first_cause,
        )
    for i, why in sorted(found.failed.items()):
        log.warning(
            "reward %r failed on sample %d of %d (%s), scored %g: %s",
            function.name,
            i,
            n,
            _identify(prompts[i], rows[i]),
            function.failure_score,
            why,
        )
    values = [found.values.get(i, function.failure_score) for i in range(n)]
    return checked_scores(function.name, values, completions), dict(sorted(found.failed.items()))


def _samples_text(indices: Sequence[int], n: int) -> str:
    if len(indices) == 1:
        return f"sample {indices[0]} of {n}"
    return f"samples {indices[0]}-{indices[-1]} of {n}"


def _identify(prompt: str, row: Mapping[str, Any]) -> str:
    """Something a person can find the sample by: its row's id, else its prompt's start."""
    if row.get("id") is not None:
        return f"row id {row['id']!r}"
    short = prompt if len(prompt) <= 80 else prompt[:79] + "…"
    return f"prompt {short!r}"


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
