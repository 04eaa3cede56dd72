"""The online loop colocated against disaggregated (actors and learners on processes of their own)
and asynchronous (algorithm.max_staleness), side by side in one invocation.

Every variant is a real `rollout run` of the same GRPO job, the CPU job of grpo_vs_trl.py
(SmolLM2-135M-Instruct fp32, 2 addition prompts x 4 completions, at most 32 new tokens,
numeric_match, one optimizer update per step), with the same seed:

  colocated-1   one process running every role, 2 threads
  colocated-2   two processes running every role (data parallel), 1 thread each
  split-k0      { actor = [0], learner = [1] }, 1 thread each, max_staleness = 0
  split-k1      the same with max_staleness = 1 (the actor samples the next batch while the
                learner trains)

and a generation-heavy job (a small random model, --heavy-model, that always writes
--heavy-new-tokens tokens; 4 prompts x 2 completions, k = 1: decoding a small batch is
bound by per-token overheads, not by arithmetic), with 1 actor + 1 learner against
2 actors + 1 learner (1 thread each: three processes on 2 cores share them).

Everything is read from the run store: perf/step_s, perf/completions_per_s, perf/tokens_per_s,
perf/weight_sync_s, perf/actor_wait_s, perf/learner_wait_s, train/staleness, reward/mean. Step 1
(start-up, the first sync, nothing to overlap) is left out of the throughput: completions over
the summed step times of steps 2..N. On split runs perf/step_s is the first learner's step
(receive, train, send the weights), which is the pipeline's period once it is full.

    python benchmarks/distributed.py --steps 6
    python benchmarks/distributed.py --only split-k1 colocated-1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import add_model_options, model_label, resolve_model
from grpo_vs_trl import RANDOM_REWARD, Job, build_job, rollout_cli, run_measured
from grpo_vs_trl import write_rollout_config as write_grpo_config

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "distributed.json"
METRICS = (
    "perf/step_s",
    "perf/completions_per_s",
    "perf/tokens_per_s",
    "perf/generate_s",
    "perf/weight_sync_s",
    "perf/weight_broadcast_s",
    "perf/actor_wait_s",
    "perf/learner_wait_s",
    "perf/train_s",
    "perf/learn_s",
    "perf/sync_s",
    "train/staleness",
    "reward/mean",
)
SPLIT_1_1 = {"cluster.nproc_per_node": 2, "cluster.placement": "{ actor = [0], learner = [1] }"}
SPLIT_2_1 = {"cluster.nproc_per_node": 3, "cluster.placement": "{ actor = [0, 1], learner = [2] }"}


@dataclass(frozen=True)
class Variant:
    name: str
    job: Job
    overrides: dict[str, Any]
    processes: int


def variants(job: Job, heavy: Job | None) -> list[Variant]:
    """The benchmark's runs. Threads: the machine's 2 cores split between the processes (one
    each), never more threads than cores, except 2 actors + 1 learner (three processes)."""
    found = [
        Variant("colocated-1", job, {"cluster.threads_per_process": 2}, 1),
        Variant(
            "colocated-2",
            job,
            {"cluster.nproc_per_node": 2, "cluster.threads_per_process": 1},
            2,
        ),
        Variant("split-k0", job, {**SPLIT_1_1, "cluster.threads_per_process": 1}, 2),
        Variant(
            "split-k1",
            job,
            {**SPLIT_1_1, "cluster.threads_per_process": 1, "algorithm.max_staleness": 1},
            2,
        ),
    ]
    if heavy is not None:
        asynchronous = {"cluster.threads_per_process": 1, "algorithm.max_staleness": 1}
        found += [
            Variant("heavy 1+1 k1", heavy, {**SPLIT_1_1, **asynchronous}, 2),
            Variant("heavy 2+1 k1", heavy, {**SPLIT_2_1, **asynchronous}, 3),
        ]
    return found


def heavy_job(job: Job, args: argparse.Namespace) -> Job:
    """Long completions of a small batch on a small model: generation dominates the step."""
    model = resolve_model(args.heavy_model, job.device)
    return replace(
        job,
        model_dir=model.directory,
        rollout_model={**model.rollout_model, "dtype": job.dtype},
        reward=RANDOM_REWARD if model.random else "numeric_match",
        max_new_tokens=args.heavy_new_tokens,
        completions_per_step=8,
        num_generations=2,
    )


def run_variant(variant: Variant, workdir: Path) -> dict[str, Any]:
    job = variant.job
    config = write_grpo_config(job, workdir)
    overrides = {
        "algorithm.max_steps": job.total_steps,
        "checkpoint.interval": job.total_steps + 1,
        "checkpoint.save_optimizer": "false",
        "run.output_dir": json.dumps(str(workdir / "runs")),
        **variant.overrides,
    }
    command = [rollout_cli(), "run", "--config", str(config)]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    print(f"{variant.name}:", " ".join(command), flush=True)
    process = run_measured(command, workdir / "run.log")
    series = read_metrics(workdir / "runs")
    return summarize(series, job, process.wall_s, process.peak_rss_gib)


def read_metrics(runs: Path) -> dict[str, dict[int, float]]:
    from rollout.planner.lockfile import read_plan
    from rollout.storage import open_store

    (plan_path,) = runs.glob("*/plan.lock")
    plan = read_plan(plan_path, check_fresh=False)
    store = open_store(plan.derived.store, create=False)
    try:
        rows = store.metrics(plan.run_id, names=list(METRICS))
    finally:
        store.close()
    series: dict[str, dict[int, float]] = {name: {} for name in METRICS}
    for row in rows:
        series[row.name][row.step] = row.value
    return series


def summarize(
    series: dict[str, dict[int, float]], job: Job, wall_s: float, peak_rss_gib: float
) -> dict[str, Any]:
    steps = sorted(series["perf/step_s"])
    steady = [s for s in steps if s > job.warmup]

    def mean(name: str) -> float | None:
        values = [series[name][s] for s in steady if s in series[name]]
        return statistics.mean(values) if values else None

    seconds = sum(series["perf/step_s"][s] for s in steady)
    tokens = series["perf/tokens_per_s"]
    return {
        "completions_per_s": job.completions_per_step * len(steady) / seconds,
        "tokens_per_s": sum(tokens[s] * series["perf/step_s"][s] for s in steady) / seconds,
        "step_s_mean": mean("perf/step_s"),
        "step_s_best": min(series["perf/step_s"][s] for s in steady),
        "generate_s_mean": mean("perf/generate_s"),
        "train_s_mean": mean("perf/train_s"),
        "learn_s_mean": mean("perf/learn_s"),
        "weight_sync_s_mean": mean("perf/weight_sync_s"),
        "weight_broadcast_s_mean": mean("perf/weight_broadcast_s"),
        "actor_wait_s_mean": mean("perf/actor_wait_s"),
        "learner_wait_s_mean": mean("perf/learner_wait_s"),
        "staleness": [series["train/staleness"].get(s) for s in steps],
        "reward_mean": [series["reward/mean"].get(s) for s in steps],
        "step_s": [series["perf/step_s"][s] for s in steps],
        "wall_s": wall_s,
        "peak_rss_gib": peak_rss_gib,
    }


COLUMNS = (
    ("completions/s", "completions_per_s", 3),
    ("tokens/s", "tokens_per_s", 1),
    ("s/step", "step_s_mean", 2),
    ("best s/step", "step_s_best", 2),
    ("generate s", "generate_s_mean", 2),
    ("train s", "train_s_mean", 2),
    ("learn s", "learn_s_mean", 2),
    ("weight sync s", "weight_sync_s_mean", 2),
    ("broadcast s", "weight_broadcast_s_mean", 2),
    ("actor wait s", "actor_wait_s_mean", 2),
    ("learner wait s", "learner_wait_s_mean", 2),
    ("wall s", "wall_s", 0),
)


def render(results: dict[str, dict[str, Any]], labels: dict[str, str]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    table = Table(title="steady state (steps 2..N), means per step")
    table.add_column("variant")
    table.add_column("job")
    for label, _, _ in COLUMNS:
        table.add_column(label, justify="right")
    table.add_column("vs colocated-1", justify="right")
    base = results.get("colocated-1", {}).get("completions_per_s")
    for name, result in results.items():
        cells = [
            "-" if result[key] is None else f"{result[key]:.{digits}f}"
            for _, key, digits in COLUMNS
        ]
        ratio = f"{result['completions_per_s'] / base:.2f}x" if base and "heavy" not in name else ""
        table.add_row(name, labels[name], *cells, ratio)
    console.print(table)
    curves = Table(title="reward/mean per step (train/staleness in brackets)")
    curves.add_column("variant")
    for name, result in results.items():
        rewards = [
            f"{r:.3f}" + (f" [{s:.0f}]" if s else "")
            for r, s in zip(result["reward_mean"], result["staleness"], strict=True)
        ]
        curves.add_row(name, " ".join(rewards))
    console.print(curves)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per run, step 1 included")
    parser.add_argument("--heavy-model", default="llama-tiny", help="the generation-heavy model")
    parser.add_argument("--heavy-new-tokens", type=int, default=256)
    parser.add_argument("--only", nargs="*", help="run these variants only (by name)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON")
    add_model_options(parser)
    args = parser.parse_args(argv)
    # What build_job reads: the CPU job of grpo_vs_trl.py, step 1 as its warm-up.
    args.prompts = args.generations = args.new_tokens = None
    args.warmup, args.steps = 1, args.steps - 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()
    job, model = build_job(args)
    wanted = set(args.only or [])
    heavy = heavy_job(job, args) if not wanted or any("heavy" in w for w in wanted) else None
    chosen = [v for v in variants(job, heavy) if not wanted or v.name in wanted]
    results, labels = {}, {}
    for variant in chosen:
        workdir = Path(tempfile.mkdtemp(prefix="rollout-bench-dist-"))
        try:
            results[variant.name] = run_variant(variant, workdir)
        except SystemExit as failed:  # run_measured's report of a failed run: keep its logs
            print(f"{variant.name} failed (logs kept in {workdir}): {failed}", flush=True)
            continue
        shutil.rmtree(workdir)
        j = variant.job
        labels[variant.name] = (
            f"{Path(j.model_dir).name[:18]}, {j.completions_per_step} x <={j.max_new_tokens} tok"
        )
        results[variant.name]["overrides"] = variant.overrides
    render(results, labels)
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": model_label(model),
        "machine": {
            "cpu_count": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"results: {args.out}; load average before {load_before}, after {os.getloadavg()}")


if __name__ == "__main__":
    main()
