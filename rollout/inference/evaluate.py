"""`rollout eval`: score a model (or a run's checkpoint) on eval suites, and report.

The job reads top to bottom in `evaluate`: resolve the suites (an eval config, or --suite and
--data; flags on top) and the model, read every suite's rows and check them against their
scorer, all before any weights load, so every mistake in the inputs is reported at once. Then
load the model once, and per suite: encode the prompts, sample `samples` completions per row (or,
for log-likelihood scoring, score each choice), score them, and summarize (score, pass@k, maj@k;
per category where rows name one). The report is plain JSON.

Sampling is deterministic: chunk c of suite S is sampled with derive_seed(seed, "eval:S:c").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.config.generation import GenerationSection
from rollout.errors import Issue, RolloutError
from rollout.harness.eval.scorers import Score, ScorerError
from rollout.inference.batch import (
    DEFAULT_BATCH_SIZE,
    build_generation_engine,
    choose_dtype,
    encode_prompt,
    generation_device,
    load_chosen_model,
    prompts_per_chunk,
    use_chat_template,
)
from rollout.inference.eval_report import (
    SuiteResult,
    build_report,
    check_report_path,
    record_metrics,
    recording_step,
    suite_result,
    write_report,
)
from rollout.inference.eval_suites import (
    MAX_LISTED,
    CheckedSuite,
    checked_suites,
    chosen_suites,
    first,
    read_eval_config,
)
from rollout.inference.model_choice import ModelChoice, choose_model
from rollout.inference.prompts import prompt_kind
from rollout.planner.builder import cuda_graph_issues
from rollout.seeds import derive_seed


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
        )
    results = []
    try:
        for suite, ids in zip(job.suites, prompt_ids, strict=True):
            hooks.on_suite(suite.spec.name, len(suite.rows), suite.spec.samples)
            sampling = Sampling(engine, job.generation, job.batch_size, job.seed)
            completions, scored = run_suite(suite, ids, sampling, loaded, hooks)
            hooks.on_suite_done(suite.spec.name)
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
        or DEFAULT_BATCH_SIZE[generation.engine],
        templated=use_chat_template(options.chat_template, choice),
        step=step,
    )


# --- prompts, sampling, scoring ------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How suites are sampled: `rollout eval`'s engine, or a training run's."""

    engine: Any
    """None when no suite samples."""
    generation: GenerationSection
    batch_size: int
    seed: int


def run_suite(
    suite: CheckedSuite,
    prompt_ids: list[list[int]],
    sampling: Sampling,
    loaded: Any,
    hooks: Hooks | None = None,
) -> tuple[list[list[str]] | None, list[list[Score]]]:
    """One suite's completions (None when it samples nothing) and their scores, per row."""
    hooks = hooks or Hooks()
    if suite.scorer.generates:
        completions = _sample(sampling, suite, prompt_ids, hooks)
        return completions, _score_completions(suite, completions)
    return None, _score_choices(suite, prompt_ids, loaded, hooks)


def encode_suites(
    suites: list[CheckedSuite],
    loaded: Any,
    *,
    context: int,
    description: str,
    templated: bool,
    system_prompt: str | None,
) -> list[list[list[int]]]:
    """Every suite's prompt ids; a prompt that (with its completion) does not fit the model's
    `context` is an issue naming its row."""
    issues: list[Issue] = []
    encoded = []
    for suite in suites:
        ids_of_suite = []
        for row, place in zip(suite.rows, suite.places, strict=True):
            prompt = suite.scorer.prompt(row)
            if prompt_kind(prompt) == "messages" and not templated:
                issues.append(
                    Issue(
                        f"suite {suite.spec.name}",
                        f"{place} of {suite.data} holds chat messages, which need the chat "
                        f"template, and {description} is used without one",
                        hint="drop --no-chat-template, or give the prompt as text",
                    )
                )
                ids_of_suite.append([])
                continue
            ids = encode_prompt(loaded, prompt, templated, system_prompt)
            ids_of_suite.append(ids)
            longest = len(ids) + (
                suite.max_new_tokens
                if suite.scorer.generates
                else max(len(_choice_ids(loaded, c)) for c in row["choices"])
            )
            if not ids or longest > context:
                issues.append(
                    Issue(
                        f"suite {suite.spec.name}",
                        f"{place} of {suite.data}: the prompt is {len(ids)} tokens and needs "
                        f"{longest} with its completion, beyond the model's context of {context}",
                        hint="shorten the prompt or lower max_new_tokens",
                    )
                )
        encoded.append(ids_of_suite)
    if issues:
        raise RolloutError(issues[:MAX_LISTED])
    return encoded


def _sample(
    sampling: Sampling, suite: CheckedSuite, prompt_ids: list[list[int]], hooks: Hooks
) -> list[list[str]]:
    """`samples` completion texts per row, in row order."""
    from rollout.engines.base import SamplingParams

    n, generation = suite.spec.samples, sampling.generation
    per_chunk = prompts_per_chunk(sampling.batch_size, n)
    texts: list[list[str]] = [[] for _ in prompt_ids]
    for begin in range(0, len(prompt_ids), per_chunk):
        end = min(begin + per_chunk, len(prompt_ids))
        params = SamplingParams(
            max_new_tokens=suite.max_new_tokens,
            temperature=suite.temperature,
            top_p=suite.top_p,
            top_k=generation.top_k,
            stop=tuple(generation.stop),
            n=n,
            seed=derive_seed(sampling.seed, f"eval:{suite.spec.name}:{begin // per_chunk}"),
        )
        completions = sampling.engine.generate(prompt_ids[begin:end], params)
        for completion in completions:  # grouped by prompt, n each
            texts[begin + completion.prompt_index].append(completion.text)
        hooks.on_rows(end, sum(len(c.token_ids) for c in completions))
    return texts


def _score_completions(suite: CheckedSuite, completions: list[list[str]]) -> list[list[Score]]:
    scored = []
    for row, place, texts in zip(suite.rows, suite.places, completions, strict=True):
        try:
            scored.append([suite.scorer.score(row, text) for text in texts])
        except ScorerError as error:  # a plugin's failure; a built-in's would be rollout's bug
            raise RolloutError(
                Issue(
                    f"suite {suite.spec.name}",
                    f"the scorer {suite.scorer.name} {error} on {place} of {suite.data}",
                    hint="fix the scorer; `rollout eval --limit N` reproduces it quickly",
                )
            ) from None
    return scored


def _score_choices(
    suite: CheckedSuite, prompt_ids: list[list[int]], loaded: Any, hooks: Hooks
) -> list[list[Score]]:
    """Log-likelihood scoring: each row's choices in one forward pass, no sampling."""
    from rollout.harness.eval.loglik import continuation_logprobs

    scored = []
    for number, (row, ids) in enumerate(zip(suite.rows, prompt_ids, strict=True), start=1):
        continuations = [f" {choice}" for choice in row["choices"]]
        sums = continuation_logprobs(
            loaded.model,
            ids,
            [_choice_ids(loaded, text) for text in continuations],
            loaded.pad_token_id,
        )
        # The scorer asks for one continuation at a time; all were computed in one pass above.
        logprob = dict(zip(continuations, sums, strict=True))
        scored.append([suite.scorer.score_choices(row, lambda _p, text, got=logprob: got[text])])
        hooks.on_rows(number, 0)
    return scored


def _choice_ids(loaded: Any, text: str) -> list[int]:
    return list(loaded.tokenizer.encode(text, add_special_tokens=False))
