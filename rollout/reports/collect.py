"""What a run report shows, read from the run store and the run's plan.lock, as JSON-able data.

Everything here is bounded whatever the run's size, so the page stays a few MB and opens fast:
series are thinned to `max_points` (rollout.reports.series), samples to `MAX_SAMPLES` from at
most `MAX_SAMPLE_STEPS` steps spread over the run, each text to
rollout.storage.base.MAX_SAMPLE_TEXT characters. The page says where it thinned.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rollout.redact import redact_text, redact_value
from rollout.reports.series import Series, bucket_width, thin
from rollout.storage.base import RunRecord, RunStore, SampleRecord, clip_text

MAX_POINTS = 2000
MAX_SAMPLE_STEPS = 400
MAX_SAMPLES = 2000

# The phases of a step, as the loops time them (rollout/runtime/phases.py): colocated, the actor's
# generate and score, then shape, learn, sync; split placements, the learner waits to receive the
# actors' batch instead (generation runs beside it, on other processes).
COLOCATED_PHASES = ("generate", "score", "shape", "learn", "sync")
SPLIT_PHASES = ("receive", "shape", "learn", "sync")


def collect(store: RunStore, run: RunRecord, *, max_points: int = MAX_POINTS) -> dict[str, Any]:
    counts = store.metric_counts(run.run_id)
    names = sorted(counts)
    # One bucket width for every series of the run, so buckets line up across metrics.
    width = bucket_width(0, run.last_step or 0, max_points)
    series = {}
    for name in names:
        if counts[name] <= max_points or width == 1:
            rows = ((m.step, m.value) for m in store.metrics(run.run_id, [name]))
            thinned = thin(name, rows, origin=0, width=width, max_points=max_points)
        else:  # thinned by the store: a million rows never cross as rows
            points = store.metric_buckets(run.run_id, name, width=width)
            thinned = Series(name, points, counts[name], width)
        series[name] = _series_json(thinned)
    return {
        "generated_at": time.time(),
        "run": _run_json(run),
        "plan": plan_summary(run),
        "max_points": max_points,
        "series": series,
        "breakdown": breakdown(names),
        "samples": samples_json(store, run.run_id),
    }


def _series_json(series: Series) -> dict[str, Any]:
    return {"points": series.points, "rows": series.rows, "bucket_steps": series.bucket_steps}


def _run_json(run: RunRecord) -> dict[str, Any]:
    error = redact_text(run.error or "")
    return {
        "run_id": run.run_id,
        "name": run.name,
        "status": run.status,
        "created_at": run.created_at,
        "started_at": run.started_at,
        "ended_at": run.ended_at,
        "last_step": run.last_step,
        "error": "\n".join(error.rstrip().splitlines()[-30:]) or None,
    }


def breakdown(names: list[str]) -> dict[str, Any] | None:
    """The step-time phases this run recorded, in step order, and its total: None without
    perf/step_s (an evaluation-only run)."""
    if "perf/step_s" not in names:
        return None
    phases = SPLIT_PHASES if "perf/receive_s" in names else COLOCATED_PHASES
    present = [f"perf/{phase}_s" for phase in phases if f"perf/{phase}_s" in names]
    return {"total": "perf/step_s", "phases": present}


def plan_summary(run: RunRecord) -> dict[str, Any]:
    """The run's plan: a few facts and its resolved config, credentials redacted; or why not."""
    path = Path(run.plan_path)
    if not path.is_absolute() and not path.exists():
        path = Path(run.run_dir) / path.name
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        plan = document["plan"]
        config = plan["config"]
    except FileNotFoundError:
        return {"missing": f"the plan file {run.plan_path} is not on this machine"}
    except (OSError, ValueError, KeyError, TypeError) as error:
        return {"missing": f"the plan file {run.plan_path} could not be read: {error}"}
    model = plan.get("model") or {}
    derived = plan.get("derived") or {}
    graph = plan.get("graph") or {}
    facts = {
        "run id": plan.get("run_id"),
        "plan sha256": document.get("sha256"),
        "algorithm": (config.get("algorithm") or {}).get("kind"),
        "model": model.get("location"),
        "parameters": model.get("num_parameters"),
        "total steps": derived.get("total_steps"),
        "prompts per step": derived.get("prompts_per_step"),
        "device": graph.get("device"),
        "processes": (graph.get("nnodes") or 1) * (graph.get("nproc_per_node") or 1),
        "rewards": ", ".join(
            f"{r.get('name')} ×{r.get('weight')}" for r in plan.get("rewards") or []
        ),
        "versions": ", ".join(f"{k} {v}" for k, v in (plan.get("versions") or {}).items() if v),
    }
    return {
        "facts": redact_value({k: v for k, v in facts.items() if v not in (None, "")}),
        "config": redact_value(config),
    }


def samples_json(store: RunStore, run_id: str) -> dict[str, Any]:
    steps = store.sample_steps(run_id)
    shown = spread(steps, MAX_SAMPLE_STEPS)
    records = store.samples(run_id, shown)[:MAX_SAMPLES]
    return {
        "steps_recorded": len(steps),
        "steps_shown": len({r.step for r in records}),
        "rows": [_sample_json(record) for record in records],
    }


def spread(steps: list[int], count: int) -> list[int]:
    """At most `count` of `steps`, evenly spread, the first and last kept."""
    if len(steps) <= count:
        return steps
    return sorted({steps[round(i * (len(steps) - 1) / (count - 1))] for i in range(count)})


def _sample_json(record: SampleRecord) -> dict[str, Any]:
    turns = None
    if record.turns is not None:
        turns = [_turn_json(t) for t in record.turns]
    return {
        "step": record.step,
        "index": record.index,
        "prompt": clip_text(record.prompt),
        "completion": None if record.completion is None else clip_text(record.completion),
        "turns": turns,
        "reward": record.reward if record.reward == record.reward else None,
        "extra": record.extra,
    }


def _turn_json(turn: dict[str, Any]) -> dict[str, Any]:
    """A turn's role and text, and its metadata (an agent call's policy version, tokens, ...)
    as short strings."""
    meta = {
        str(key): clip_text(str(value), 100)
        for key, value in turn.items()
        if key not in ("role", "content") and value is not None
    }
    return {
        "role": str(turn.get("role", "")),
        "content": clip_text(str(turn.get("content", ""))),
        "meta": meta,
    }
