"""The statistics of an eval over k samples per row: pass@k (the unbiased estimator of Chen et
al. 2021), maj@k (majority vote over the samples' answers), and their means per suite and per
category. Plain numbers in, plain numbers out."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k samples, drawn without replacement from n samples of
    which c are correct, is correct: 1 - C(n-c, k) / C(n, k).

    Computed as a product (1 - prod_{i=n-c+1}^{n} (1 - k/i)), as Chen et al. do, so it neither
    overflows nor loses precision for large n.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0  # every draw of k holds a correct sample
    failing = 1.0
    for i in range(n - c + 1, n + 1):
        failing *= 1.0 - k / i
    return 1.0 - failing


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """1.0 when the most common answer among the first k samples is a correct one, else 0.0.

    `answers` are normalized already (by the scorer: "1,000" and "1000" are one answer); None is
    a sample that gave no answer, which never votes. A tie goes to the answer given first, so
    the result does not depend on hash order. Correctness is a property of the answer, so the
    first sample that gave the winning answer speaks for it.
    """
    if len(answers) != len(correct):
        raise ValueError("maj_at_k: answers and correct differ in length")
    if not 1 <= k <= len(answers):
        raise ValueError(f"maj_at_k: need 1 <= k <= {len(answers)} samples, got k={k}")
    votes = Counter(answer for answer in answers[:k] if answer is not None)
    if not votes:
        return 0.0
    most = max(votes.values())
    winner = next(answer for answer in answers[:k] if votes.get(answer) == most)
    return 1.0 if correct[answers.index(winner)] else 0.0


@dataclass(frozen=True)
class RowResult:
    """One data row's samples, scored."""

    category: str | None
    values: list[float]
    """Each sample's score in [0, 1] (IFEval: the share of instructions followed)."""
    correct: list[bool]
    """Each sample fully right (IFEval: every instruction followed)."""
    answers: list[str | None] | None
    """Each sample's normalized answer; None for a scorer without answers to vote on."""


def summarize(rows: Sequence[RowResult], ks: Sequence[int]) -> dict[str, float | None]:
    """Means over rows: score (mean sample score), pass@k for each k, maj@k for each k > 1
    (None where the scorer has no answers to vote on). Every row holds the same number of
    samples n, and every k <= n."""
    if not rows:
        raise ValueError("summarize: no rows")
    summary: dict[str, float | None] = {
        "score": _mean([sum(row.values) / len(row.values) for row in rows])
    }
    for k in ks:
        summary[f"pass@{k}"] = _mean([pass_at_k(len(r.correct), sum(r.correct), k) for r in rows])
    for k in ks:
        if k > 1:
            voted = [maj_at_k(r.answers, r.correct, k) for r in rows if r.answers is not None]
            summary[f"maj@{k}"] = _mean(voted) if len(voted) == len(rows) else None
    return summary


def by_category(
    rows: Sequence[RowResult], ks: Sequence[int]
) -> dict[str, tuple[int, dict[str, float | None]]]:
    """summarize() for each category the rows name (rows without one are left out), with the
    number of rows in it, in order of first appearance."""
    groups: dict[str, list[RowResult]] = {}
    for row in rows:
        if row.category is not None:
            groups.setdefault(row.category, []).append(row)
    return {name: (len(group), summarize(group, ks)) for name, group in groups.items()}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
