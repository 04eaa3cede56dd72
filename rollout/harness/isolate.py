"""Find the samples a batched plugin fails on, by bisection.

A sidecar that hangs or crashes on a batch (twice: the host resubmits it once) cannot say which
sample did it; a batched plugin that raises cannot either (it was called once, for the whole
batch). So the batch is split in halves, each half sent on its own (one attempt, no resubmission:
the whole batch already failed twice), and a half that fails is split again, down to single
samples. What a half that answered returned is kept: those samples need no second call.

The work is bounded twice over:

- depth: halving reaches single samples after ceil(log2 n) levels; a range is never split more
  than ceil(log2 n) + 1 times (a guard, should the split ever not halve);
- time: `isolation_budget_s`: no new attempt starts once the budget is spent, so the whole
  search takes at most the budget plus one attempt (its deadline and a child's restart).
  Ranges left unexplored then are reported as failed with the reason.

One culprit among n samples costs one failing attempt per level (ceil(log2 n) deadlines for a
hang) plus the quick answers of the halves that do not hold it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Attempt = Callable[[Sequence[int]], Sequence[Any]]
"""Calls the plugin on the samples at these indices (of the original batch), in order; returns
one value per index, or raises whatever went wrong (its text becomes the cause)."""


def isolation_budget_s(timeout_s: float, n: int) -> float:
    """How long the bisection of a batch of n may take: two deadlines per level.

    One culprit costs one deadline per level (a hang) and the child's restart; the factor 2
    leaves room for the restarts and for a second culprit."""
    return 2.0 * timeout_s * (_levels(n) + 1)


@dataclass
class Isolation:
    """values: index -> what the plugin returned for it in a sub-batch that answered.
    failed: index -> why it failed (alone, or as part of a range the budget left unexplored).
    Every index of the batch is in exactly one of the two."""

    values: dict[int, Any] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    attempts: int = 0
    elapsed_s: float = 0.0


def isolate(
    n: int,
    attempt: Attempt,
    *,
    first_cause: str,
    budget_s: float,
    stop_at_first: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> Isolation:
    """Bisect a batch of n samples that failed as a whole with `first_cause`.

    stop_at_first: return once one sample is found failing alone (enough to name it when the
    step stops anyway); the samples not reached are then in neither dict.
    """
    start = clock()
    found = Isolation()
    if n == 1:  # the batch was the sample
        found.failed[0] = first_cause
        return found
    max_splits = _levels(n) + 1
    # Depth first, left half first: a stop_at_first search ends at the first culprit.
    pending: list[tuple[list[int], int]] = [(half, 1) for half in reversed(_halves(list(range(n))))]
    while pending:
        indices, splits = pending.pop()
        spent = clock() - start
        if spent >= budget_s:
            reason = (
                f"not isolated: the batch failed ({first_cause}) and the {budget_s:g} s "
                f"allowed to find the failing samples by bisection were spent"
            )
            for rest, _ in [(indices, splits), *pending]:
                found.failed.update(dict.fromkeys(rest, reason))
            break
        found.attempts += 1
        try:
            values = list(attempt(indices))
        except Exception as error:  # the plugin's failure, whatever it was, is what we look for
            cause = str(error)
            if len(indices) == 1:
                found.failed[indices[0]] = cause
                if stop_at_first:
                    break
            elif splits >= max_splits:
                found.failed.update(dict.fromkeys(indices, cause))
            else:
                pending.extend((half, splits + 1) for half in reversed(_halves(indices)))
            continue
        if len(values) != len(indices):
            cause = f"returned {len(values)} values for {len(indices)} samples"
            found.failed.update(dict.fromkeys(indices, cause))
            continue
        found.values.update(zip(indices, values, strict=True))
    found.elapsed_s = clock() - start
    return found


def _halves(indices: list[int]) -> list[list[int]]:
    middle = (len(indices) + 1) // 2
    return [indices[:middle], indices[middle:]]


def _levels(n: int) -> int:
    return max(1, math.ceil(math.log2(max(n, 1))))
