"""A run report as one self-contained index.html: the page (report.html, its CSS and JS inline)
with the report's data in a JSON script element, so it opens from disk with no network."""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

from rollout.reports.collect import MAX_POINTS, collect
from rollout.storage.base import RunRecord, RunStore

PLACEHOLDER = "/*REPORT_DATA*/"


def write_report(
    store: RunStore, run: RunRecord, out: Path, *, max_points: int = MAX_POINTS
) -> Path:
    """Write `out`/index.html for `run`; its path."""
    page = render(collect(store, run, max_points=max_points))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "index.html"
    path.write_text(page, encoding="utf-8")
    return path


def render(data: dict[str, Any]) -> str:
    template = resources.files("rollout.reports").joinpath("report.html").read_text("utf-8")
    return template.replace(PLACEHOLDER, embeddable_json(data), 1)


def embeddable_json(data: Any) -> str:
    """`data` as JSON that cannot end the script element it sits in: model-written text may hold
    `</script>` or `<!--`, so every '<' is escaped (JSON.parse reads \\u003c back as '<')."""
    text = json.dumps(_finite(data), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null (a plugin's extra facts may hold them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if value is None or isinstance(value, str | int | bool):
        return value
    return str(value)
