"""Metric series thinned for plotting: a plot has a few thousand pixels, a run a million rows.

A series longer than `max_points` is cut into buckets of equal step width over the run's steps,
each kept as (step, mean, min, max): the mean is the line, min and max its envelope, so a spike
inside a bucket still shows. Every series of a run is bucketed with the same width and origin,
so a metric's mean and its std (reward/mean ± reward/std) fall in the same buckets.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

Point = tuple[int, float | None, float | None, float | None]
"""(step, mean, min, max); None for a bucket or step whose values were all NaN."""


@dataclass(frozen=True)
class Series:
    name: str
    points: list[Point]
    rows: int
    """How many rows the store holds for it (its points may be fewer: see `bucket_steps`)."""
    bucket_steps: int
    """Steps per point: 1 when every recorded step is a point of its own."""


def bucket_width(first_step: int, last_step: int, max_points: int) -> int:
    """The steps per bucket for a run whose steps span first..last: 1 if they fit."""
    span = last_step - first_step + 1
    return max(1, math.ceil(span / max_points))


def thin(
    name: str, rows: Iterable[tuple[int, float]], *, origin: int, width: int, max_points: int
) -> Series:
    """`rows` ((step, value) in step order) as a Series: the rows themselves when there are at
    most `max_points`, else one point per bucket of `width` steps from `origin`, at the bucket's
    first step (so buckets of different series line up)."""
    rows = list(rows)
    if len(rows) <= max_points or width == 1:
        points: list[Point] = []
        for step, value in rows:
            kept = _finite(value)
            points.append((step, kept, kept, kept))
        return Series(name, points, len(rows), 1)
    buckets: dict[int, list[float]] = {}
    for step, value in rows:
        values = buckets.setdefault((step - origin) // width, [])
        if math.isfinite(value):
            values.append(value)
    points = []
    for index in sorted(buckets):
        values = buckets[index]
        step = origin + index * width
        if values:
            points.append((step, sum(values) / len(values), min(values), max(values)))
        else:
            points.append((step, None, None, None))
    return Series(name, points, len(rows), width)


def _finite(value: float) -> float | None:
    """JSON has no NaN or infinity: a diverged value is a gap in the line."""
    return value if math.isfinite(value) else None
