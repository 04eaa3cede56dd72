"""`rollout eval`: score a model (or a run's checkpoint) on eval suites, and report.

The job reads top to bottom in `evaluate`: resolve the suites (an eval config, or --suite and
--data; flags on top) and the model, read every suite's rows and check them against their
scorer, all before any weights load, so every mistake in the inputs is reported at once. Then
load the model once, and per suite: encode the prompts, sample `samples` completions per row (or,
for log-likelihood scoring, score each choice), score them, and summarize (score, pass@k, maj@k;
per category where rows name one). The report is plain JSON.

Checking the suites is the planner's (rollout.planner.eval_suites), running and summarizing them
the harness's (rollout.harness.eval.suites, results), as a training run's [[eval.suites]] are.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from rollout.config.generation import GenerationSection
from rollout.engines.base import SamplingParams, default_batch_size
from rollout.errors import Issue, RolloutError
from rollout.harness.eval.results import SuiteResult, suite_result
from rollout.harness.eval.suites import CheckedSuite, Sampling, encode_suites, run_suite
from rollout.inference.batch import (
    build_generation_engine,
    choose_dtype,
    generation_device,
    load_chosen_model,
    resolve_engine_choice,
    use_chat_template,
)
from rollout.inference.eval_report import (
    build_report,
    check_report_path,
    record_metrics,
    recording_step,
    write_report,
)
from rollout.inference.eval_suites import chosen_suites, read_eval_config
from rollout.inference.model_choice import ModelChoice, choose_model
from rollout.planner.builder import cuda_graph_issues
from rollout.planner.eval_suites import checked_suites, first


@dataclass(frozen=True)
class EvalOptions:
    """What `rollout eval` was asked; None means "not given" (the config's, or a default)."""

    config: Path | None = None
    model: str | None = None
    checkpoint: str | None = None
    store: str | None = None
    suites: tuple[str, ...] = ()
    """--suite: without --config the scorer to run; with it, the config's suites to run."""
    data: str | None = None
    samples: int | None = None
    k: tuple[int, ...] | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    limit: int | None = None
    chat_template: bool | None = None
    seed: int | None = None
    batch_size: int | None = None
    device: str = "auto"
    report: Path | None = None
    run: str | None = None
    """Record the scores in the run store as metrics of this run, at the checkpoint's step."""


@dataclass
class Hooks:
    """Progress callbacks; all optional."""

    on_status: Callable[[str], None] = lambda message: None
    on_suite: Callable[[str, int, int], None] = lambda name, rows, samples: None
    """A suite starts: (name, rows, samples per row)."""
    on_rows: Callable[[int, int], None] = lambda rows_done, new_tokens: None
    on_suite_done: Callable[[str], None] = lambda name: None


@dataclass(frozen=True)
class EvalResult:
    model: str
    suites: list[SuiteResult]
    seconds: float
    report: dict[str, Any]
    recorded: int = 0
    """Metrics written to the run store (with --run)."""


@dataclass(frozen=True)
class _Job:
    """Everything checked before any weights load."""

    choice: ModelChoice
    generation: GenerationSection
    suites: list[CheckedSuite]
    seed: int
    device: str
    dtype: str
    batch_size: int
    templated: bool
    """Prompts go through the model's chat template."""
    step: int | None
    """With --run: the checkpoint's step, to record the scores at."""
    engine_plugin: Any = None
    """An engine plugin's resolved factory and identity (None for hf, vllm)."""


def evaluate(options: EvalOptions, hooks: Hooks | None = None) -> EvalResult:
    """Run every suite; write the report when options.report says where. RolloutError for every
    user mistake, raised before any weights load."""
    hooks = hooks or Hooks()
    started = time.perf_counter()
    job = prepare(options)
    load_on = "cpu" if job.generation.engine == "vllm" else job.device
    hooks.on_status(f"loading {job.choice.description} ({job.dtype}, {load_on})")
    loaded = load_chosen_model(job.choice, job.dtype, load_on)
    prompt_ids = encode_suites(
        job.suites,
        loaded,
        context=job.choice.facts.context_length,
        description=job.choice.description,
        templated=job.templated,
        system_prompt=job.choice.system_prompt,
    )
    engine = None
    if any(suite.scorer.generates for suite in job.suites):
        engine = build_generation_engine(
            job.choice,
            job.generation,
            loaded,
            device=job.device,
            batch_size=job.batch_size,
            seed=job.seed,
            dtype=job.dtype,
            plugin=job.engine_plugin,
        )
    sampling = Sampling(
        engine,
        partial(SamplingParams, top_k=job.generation.top_k, stop=tuple(job.generation.stop)),
        job.batch_size,
        job.seed,
    )
    results = []
    try:
        for suite, ids in zip(job.suites, prompt_ids, strict=True):
            hooks.on_suite(suite.name, len(suite.rows), suite.samples)
            completions, scored = run_suite(suite, ids, sampling, loaded, hooks.on_rows)
            hooks.on_suite_done(suite.name)
            results.append(suite_result(suite, completions, scored))
    finally:
        if engine is not None:
            engine.close()
    seconds = time.perf_counter() - started
    report = build_report(job.choice, job.seed, job.templated, results, seconds)
    if options.report is not None:
        write_report(options.report, report)
    recorded = 0
    if options.run is not None and job.step is not None:
        recorded = record_metrics(options.run, options.store, job.step, results)
        hooks.on_status(f"recorded {recorded} metrics of run {options.run} at step {job.step}")
    return EvalResult(job.choice.description, results, seconds, report, recorded)


def prepare(options: EvalOptions) -> _Job:
    """Check everything that can be checked without loading weights: the report path, the
    suites and their rows, the model, the run to record to, the settings."""
    if options.report is not None:
        check_report_path(options.report)
    if options.store is not None and options.checkpoint is None and options.run is None:
        raise RolloutError(
            Issue(
                "--store",
                "names the run store that --checkpoint RUN_ID or --run is looked up in, and "
                "neither is given",
                hint="drop --store, or pass --checkpoint / --run",
            )
        )
    config = read_eval_config(options.config) if options.config is not None else None
    specs = chosen_suites(options, config)
    choice = choose_model(
        config=options.config if config is not None and config.model is not None else None,
        model=options.model,
        checkpoint=options.checkpoint,
        store=options.store,
    )
    generation = config.generation if config is not None else choice.generation
    step = recording_step(options.run, options.store, choice) if options.run is not None else None
    suites = checked_suites(specs, generation)
    if generation.engine == "vllm" and not all(suite.scorer.generates for suite in suites):
        raise RolloutError(
            Issue(
                "generation.engine",
                "mmlu_loglik reads log-probs from the model itself, which the vllm engine "
                "does not keep here",
                hint="use engine 'hf' for an eval with an mmlu_loglik suite",
            )
        )
    if not any(suite.scorer.generates for suite in suites):
        unread = [("--seed", options.seed), ("--max-batch-size", options.batch_size)]
        issues = [
            Issue(flag, "only log-likelihood suites run: nothing is sampled", value=value)
            for flag, value in unread
            if value is not None
        ]
        if issues:
            raise RolloutError(issues)
    device = generation_device(options.device, generation.engine)
    graph_issues = cuda_graph_issues(
        generation, device, choice.facts.model_type, where=f"--device {options.device}"
    )
    if graph_issues:
        raise RolloutError(graph_issues)
    return _Job(
        choice=choice,
        generation=generation,
        suites=suites,
        seed=first(options.seed, config.seed if config is not None else None, choice.seed, 0),
        device=device,
        dtype=choose_dtype(choice, device),
        batch_size=first(options.batch_size, generation.max_batch_size)
        or default_batch_size(generation.engine),
        templated=use_chat_template(options.chat_template, choice),
        step=step,
        engine_plugin=resolve_engine_choice(generation, from_flag=False, config=options.config),
    )
