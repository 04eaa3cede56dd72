"""A suite's results: its summary (score, pass@k, maj@k; per category where rows name one),
every row's record for the report, and its scores named as run-store metrics. What `rollout
eval` reports and a training run's [[eval.suites]] record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout.harness.eval.metrics import RowResult, by_category, summarize
from rollout.harness.eval.scorers import Score
from rollout.harness.eval.suites import CheckedSuite


@dataclass(frozen=True)
class SuiteResult:
    name: str
    scorer: str
    data: str
    samples: int
    ks: list[int]
    settings: dict[str, Any]
    summary: dict[str, float | None]
    categories: dict[str, tuple[int, dict[str, float | None]]]
    rows: list[dict[str, Any]] = field(repr=False)
    plugin: dict[str, Any] | None = None


def suite_result(
    suite: CheckedSuite, completions: list[list[str]] | None, scored: list[list[Score]]
) -> SuiteResult:
    rows = [
        RowResult(
            category=row.get("category"),
            values=[score.value for score in scores],
            correct=[score.correct for score in scores],
            answers=[score.answer for score in scores] if suite.scorer.votes else None,
        )
        for row, scores in zip(suite.rows, scored, strict=True)
    ]
    records = []
    for index, (row, scores) in enumerate(zip(suite.rows, scored, strict=True)):
        record: dict[str, Any] = {"index": index, "category": row.get("category")}
        if completions is not None:
            record["completions"] = completions[index]
        record["scores"] = [score.value for score in scores]
        record["correct"] = [score.correct for score in scores]
        record["answers"] = [score.answer for score in scores]
        records.append(record)
    settings: dict[str, Any] = {"samples": suite.samples, "limit": suite.limit}
    if suite.scorer.generates:
        settings |= {
            "max_new_tokens": suite.max_new_tokens,
            "temperature": suite.temperature,
            "top_p": suite.top_p,
        }
    return SuiteResult(
        name=suite.name,
        scorer=suite.scorer.name,
        data=suite.data,
        samples=suite.samples,
        ks=suite.ks,
        settings=settings,
        summary=summarize(rows, suite.ks),
        categories=by_category(rows, suite.ks),
        rows=records,
        plugin=suite.plugin,
    )


def metric_names(result: SuiteResult) -> dict[str, float]:
    """A suite's scores as run-store metrics: eval/<suite>/<score> and, per category,
    eval/<suite>/<category>/<score>; scores that were not measured (None) are left out."""
    named = {
        f"eval/{result.name}/{name}": value
        for name, value in result.summary.items()
        if value is not None
    }
    for category, (_, summary) in result.categories.items():
        named |= {
            f"eval/{result.name}/{category}/{name}": value
            for name, value in summary.items()
            if value is not None
        }
    return named
