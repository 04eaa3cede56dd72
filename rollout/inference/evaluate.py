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

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollout.config.evaluation import SCORER_NAMES, EvalConfig, EvalSuite, suite_issues
from rollout.config.generation import GenerationSection
from rollout.config.load import read_config_file
from rollout.config.validate import translate_errors
from rollout.errors import ConfigError, Issue, RolloutError, did_you_mean
from rollout.harness.eval.metrics import RowResult, by_category, summarize
from rollout.harness.eval.scorers import SCORERS, FunctionScorer, Score, Scorer, ScorerError
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
from rollout.inference.model_choice import ModelChoice, choose_model
from rollout.inference.prompts import prompt_kind, read_rows
from rollout.planner.builder import cuda_graph_issues
from rollout.seeds import derive_seed

MAX_LISTED = 10
REPORT_FORMAT = 1

# The suite field each flag overrides, and the flag to name when its value breaks a rule.
_FLAGS = {
    "data": "--data",
    "samples": "--samples",
    "k": "--k",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "limit": "--limit",
}
_SAMPLING = {"samples", "k", "max_new_tokens", "temperature"}
"""The flags that change how a suite samples: a suite that samples nothing does not take them."""


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
class _Chosen:
    """A suite to run, with the flags applied, before its data is read."""

    spec: EvalSuite
    data_base: Path
    """Where a relative data path starts: the config's directory, or the current one (--data)."""
    plugin_base: Path
    """Where a './file.py:function' scorer starts: the config's directory."""
    where: Callable[[str], str]
    """Where to report a problem with one of its fields: the flag that set it, or its config
    path."""


@dataclass(frozen=True)
class _Suite:
    """A suite with everything checked and every setting resolved."""

    spec: EvalSuite
    scorer: Scorer
    plugin: dict[str, Any] | None
    """A plugin scorer's identity (its module or file, version or sha256), for the report."""
    data: str
    rows: list[dict[str, Any]]
    places: list[str]
    ks: list[int]
    temperature: float
    max_new_tokens: int
    top_p: float


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


@dataclass(frozen=True)
class EvalResult:
    model: str
    suites: list[SuiteResult]
    seconds: float
    report: dict[str, Any]
    recorded: int = 0
    """Metrics written to the run store (with --run)."""


def evaluate(options: EvalOptions, hooks: Hooks | None = None) -> EvalResult:
    """Run every suite; write the report when options.report says where. RolloutError for every
    user mistake, raised before any weights load."""
    hooks = hooks or Hooks()
    started = time.perf_counter()
    if options.report is not None:
        _check_report(options.report)
    config = _read_config(options.config) if options.config is not None else None
    specs = _chosen_suites(options, config)
    choice = choose_model(
        config=options.config if config is not None and config.model is not None else None,
        model=options.model,
        checkpoint=options.checkpoint,
        store=options.store,
    )
    generation = config.generation if config is not None else choice.generation
    step = _recording_step(options, choice) if options.run is not None else None
    seed = _first(options.seed, config.seed if config is not None else None, choice.seed, 0)
    suites = _checked_suites(specs, generation, options)
    device = generation_device(options.device, generation.engine)
    graph_issues = cuda_graph_issues(
        generation, device, choice.facts.model_type, where=f"--device {options.device}"
    )
    if graph_issues:
        raise RolloutError(graph_issues)
    templated = use_chat_template(options.chat_template, choice)
    batch_size = (
        _first(options.batch_size, generation.max_batch_size)
        or DEFAULT_BATCH_SIZE[generation.engine]
    )
    dtype = choose_dtype(choice, device)

    load_on = "cpu" if generation.engine == "vllm" else device
    hooks.on_status(f"loading {choice.description} ({dtype}, {load_on})")
    loaded = load_chosen_model(choice, dtype, load_on)
    prompt_ids = _encode_suites(suites, loaded, choice, templated)
    scored_by_loglik = any(not suite.scorer.generates for suite in suites)
    if scored_by_loglik and generation.engine == "vllm":
        raise RolloutError(
            Issue(
                "generation.engine",
                "mmlu_loglik reads log-probs from the model itself, which the vllm engine "
                "does not keep here",
                hint="use engine 'hf' for an eval with an mmlu_loglik suite",
            )
        )
    engine = None
    if any(suite.scorer.generates for suite in suites):
        engine = build_generation_engine(
            choice,
            generation,
            loaded,
            device=device,
            batch_size=batch_size,
            seed=seed,
            dtype=dtype,
        )
    results = []
    try:
        for suite, ids in zip(suites, prompt_ids, strict=True):
            hooks.on_suite(suite.spec.name, len(suite.rows), suite.spec.samples)
            if suite.scorer.generates:
                completions = _sample(suite, ids, engine, generation, batch_size, seed, hooks)
                scored = _score_completions(suite, completions)
            else:
                completions = None
                scored = _score_choices(suite, ids, loaded, hooks)
            hooks.on_suite_done(suite.spec.name)
            results.append(_result(suite, completions, scored))
    finally:
        if engine is not None:
            engine.close()
    seconds = time.perf_counter() - started
    report = _report(choice, seed, templated, results, seconds)
    if options.report is not None:
        write_report(options.report, report)
    recorded = 0
    if options.run is not None and step is not None:
        recorded = record_metrics(options.run, options.store, step, results)
        hooks.on_status(f"recorded {recorded} metrics of run {options.run} at step {step}")
    return EvalResult(choice.description, results, seconds, report, recorded)


def _first(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)


# --- suites --------------------------------------------------------------------------------------


def _read_config(path: Path) -> EvalConfig:
    raw = read_config_file(path)
    try:
        return EvalConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(
            translate_errors(exc, prefix=(), root=EvalConfig), source=str(path)
        ) from None


def _chosen_suites(options: EvalOptions, config: EvalConfig | None) -> list[_Chosen]:
    """Each suite to run, with the flags applied."""
    given = _given_flags(options)
    if config is None:
        return [_suite_from_flags(options, given)]
    by_name = {suite.name: (index, suite) for index, suite in enumerate(config.suites)}
    unknown = [name for name in options.suites if name not in by_name]
    if unknown:
        raise RolloutError(
            [
                Issue(
                    "--suite",
                    f"{options.config} has no suite {name!r}; its suites: {', '.join(by_name)}",
                    value=name,
                    hint=did_you_mean(name, by_name),
                )
                for name in unknown
            ]
        )
    chosen = [by_name[name] for name in dict.fromkeys(options.suites)] or list(
        enumerate(config.suites)
    )
    if options.data is not None and len(chosen) != 1:
        raise RolloutError(
            Issue(
                "--data",
                f"replaces one suite's data, and {len(chosen)} suites are chosen",
                hint="pick the suite whose data to replace with --suite NAME",
            )
        )
    base = options.config.resolve().parent
    suites = []
    for index, spec in chosen:
        # Sampling flags apply to the suites that sample; a log-likelihood suite keeps its own.
        applied = {
            key: value for key, value in given.items() if _samples(spec) or key not in _SAMPLING
        }

        def where(key: str, index: int = index, applied: dict = applied) -> str:
            return _FLAGS[key] if key in applied else f"suites[{index}].{key}"

        merged = _with_flags(spec.model_dump(), applied, where)
        data_base = Path.cwd() if "data" in applied else base
        suites.append(_Chosen(merged, data_base, base, where))
    unused = [key for key in given if key in _SAMPLING]
    if unused and not any(_samples(spec) for _, spec in chosen):
        raise RolloutError(
            [
                Issue(
                    _FLAGS[key],
                    "means nothing here: the chosen suites sample nothing (mmlu_loglik)",
                )
                for key in unused
            ]
        )
    return suites


def _suite_from_flags(options: EvalOptions, given: dict[str, Any]) -> _Chosen:
    issues = []
    if len(options.suites) != 1:
        issues.append(
            Issue(
                "--suite",
                "name one suite to run: " + " | ".join(SCORER_NAMES)
                if not options.suites
                else "without --config, name exactly one suite",
                hint="or pass --config eval.toml to run several",
            )
        )
    elif options.suites[0] not in SCORER_NAMES:
        name = options.suites[0]
        issues.append(
            Issue(
                "--suite",
                f"is not a built-in suite; the suites: {', '.join(SCORER_NAMES)}",
                value=name,
                hint=did_you_mean(name.replace("-", "_"), SCORER_NAMES),
            )
        )
    if options.data is None:
        issues.append(
            Issue(
                "--data",
                "the suite needs its rows: a .jsonl or .parquet file",
                hint="--data FILE.jsonl",
            )
        )
    if issues:
        raise RolloutError(issues)

    def where(key: str) -> str:
        return _FLAGS.get(key, "--suite")

    name = options.suites[0]
    suite = _with_flags({"name": name, "scorer": name}, given, where)
    return _Chosen(suite, Path.cwd(), Path.cwd(), where)


def _samples(spec: EvalSuite) -> bool:
    builtin = SCORERS.get(spec.scorer)
    return builtin is None or builtin.generates  # a plugin scores completions


def _scorer(ref: str, base_dir: Path, used_by: str) -> tuple[Scorer, dict[str, Any] | None]:
    """A built-in scorer by name, or a plugin resolved as rewards are (module, file or entry
    point in the group rollout.scorers), with its identity."""
    if ref in SCORERS:
        return SCORERS[ref], None
    from rollout.plugins.resolve import resolve_plugin

    resolved = resolve_plugin(
        ref,
        base_dir=base_dir,
        used_by=used_by,
        group="rollout.scorers",
        builtins={name: scorer.score for name, scorer in SCORERS.items()},
    )
    return FunctionScorer(ref, resolved.fn), resolved.identity.model_dump(mode="json")


def _given_flags(options: EvalOptions) -> dict[str, Any]:
    given = {
        "data": options.data,
        "samples": options.samples,
        "k": list(options.k) if options.k else None,
        "max_new_tokens": options.max_new_tokens,
        "temperature": options.temperature,
        "limit": options.limit,
    }
    return {key: value for key, value in given.items() if value is not None}


def _with_flags(
    base: dict[str, Any], given: dict[str, Any], where: Callable[[str], str]
) -> EvalSuite:
    try:
        suite = EvalSuite.model_validate({**base, **given})
    except ValidationError as exc:
        issues = translate_errors(exc, prefix=(), root=EvalSuite)
        raise ConfigError([_at(issue, where) for issue in issues]) from None
    issues = suite_issues(suite, where)
    if issues:
        raise ConfigError(issues)
    return suite


def _at(issue: Issue, where: Callable[[str], str]) -> Issue:
    """A suite field's issue, reported where that field was set (a flag or the config)."""
    return replace(issue, path=where(issue.path.split(".")[0].split("[")[0]))


def _checked_suites(
    specs: list[_Chosen],
    generation: GenerationSection,
    options: EvalOptions,
) -> list[_Suite]:
    """Each suite's rows read and checked against its scorer, and its sampling settings
    resolved; every problem in every suite is reported together."""
    issues: list[Issue] = []
    suites = []
    for chosen in specs:
        spec, where = chosen.spec, chosen.where
        try:
            scorer, plugin = _scorer(spec.scorer, chosen.plugin_base, where("scorer"))
        except RolloutError as error:
            issues.extend(error.issues)
            continue
        temperature = _first(spec.temperature, 0.0 if spec.samples == 1 else generation.temperature)
        if scorer.generates and spec.samples > 1 and temperature == 0:
            issues.append(
                Issue(
                    where("temperature")
                    if spec.temperature is not None
                    else "generation.temperature",
                    f"{spec.samples} samples at temperature 0 are all the same completion",
                    hint="sample at a temperature above 0 (e.g. 0.8), or take 1 sample",
                )
            )
        try:
            rows = read_rows(spec.data, where("data"), chosen.data_base, limit=spec.limit)
        except RolloutError as error:
            issues.extend(error.issues)
            continue
        issues.extend(
            _row_issues(scorer, rows.records, rows.places or [], rows.location, where("data"))
        )
        suites.append(
            _Suite(
                spec=spec,
                scorer=scorer,
                plugin=plugin,
                data=rows.location,
                rows=rows.records,
                places=rows.places or [],
                ks=sorted(set(spec.k)) if spec.k else sorted({1, spec.samples}),
                temperature=temperature,
                max_new_tokens=_first(spec.max_new_tokens, generation.max_new_tokens),
                top_p=_first(spec.top_p, generation.top_p),
            )
        )
    if issues:
        raise RolloutError(issues)
    return suites


def _row_issues(
    scorer: Scorer, rows: list[dict[str, Any]], places: list[str], location: str, option: str
) -> list[Issue]:
    issues = []
    for row, place in zip(rows, places, strict=True):
        for name, problem in scorer.problems(row):
            issues.append(Issue(option, f"{place} of {location}: field {name!r} {problem}"))
    if len(issues) > MAX_LISTED:
        more = len(issues) - MAX_LISTED
        issues = [
            *issues[:MAX_LISTED],
            Issue(option, f"... and {more} more problems in {location}"),
        ]
    return issues


# --- prompts, sampling, scoring ------------------------------------------------------------------


def _encode_suites(
    suites: list[_Suite], loaded: Any, choice: ModelChoice, templated: bool
) -> list[list[list[int]]]:
    """Every suite's prompt ids; a prompt that (with its completion) does not fit the model's
    context is an issue naming its row."""
    context = choice.facts.context_length
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
                        f"template, and {choice.description} is used without one",
                        hint="drop --no-chat-template, or give the prompt as text",
                    )
                )
                ids_of_suite.append([])
                continue
            ids = encode_prompt(loaded, prompt, templated, choice.system_prompt)
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
    suite: _Suite,
    prompt_ids: list[list[int]],
    engine: Any,
    generation: GenerationSection,
    batch_size: int,
    seed: int,
    hooks: Hooks,
) -> list[list[str]]:
    """`samples` completion texts per row, in row order."""
    from rollout.engines.base import SamplingParams

    n = suite.spec.samples
    per_chunk = prompts_per_chunk(batch_size, n)
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
            seed=derive_seed(seed, f"eval:{suite.spec.name}:{begin // per_chunk}"),
        )
        completions = engine.generate(prompt_ids[begin:end], params)
        for completion in completions:  # grouped by prompt, n each
            texts[begin + completion.prompt_index].append(completion.text)
        hooks.on_rows(end, sum(len(c.token_ids) for c in completions))
    return texts


def _score_completions(suite: _Suite, completions: list[list[str]]) -> list[list[Score]]:
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
    suite: _Suite, prompt_ids: list[list[int]], loaded: Any, hooks: Hooks
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


# --- the run store -------------------------------------------------------------------------------


def _recording_step(options: EvalOptions, choice: ModelChoice) -> int:
    """The step to record at: the checkpoint's, which must be of run `options.run`; the run
    must be in the store. Checked before any weights load."""
    from rollout.storage import check_run_id, default_store_location, find_run, open_store

    run = options.run
    if choice.checkpoint is None:
        raise RolloutError(
            Issue(
                "--run",
                "records the scores at a checkpoint's step, and no --checkpoint is given",
                hint=f"pass --checkpoint {run} (its latest) or a checkpoint directory of it",
            )
        )
    if choice.checkpoint_run is not None and choice.checkpoint_run != run:
        raise RolloutError(
            Issue(
                "--run",
                f"the checkpoint {choice.checkpoint} belongs to run {choice.checkpoint_run}",
                value=run,
                hint=f"--run {choice.checkpoint_run}, or a checkpoint of run {run}",
            )
        )
    check_run_id(run)
    location = options.store or default_store_location()
    store = open_store(location, create=False)
    try:
        find_run(store, run, location)
    finally:
        store.close()
    return int(choice.checkpoint.name.removeprefix("step-"))


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


def record_metrics(
    run: str, store_location: str | None, step: int, results: list[SuiteResult]
) -> int:
    """Write every suite's scores as metrics of `run` at `step`; how many were written."""
    from rollout.storage import default_store_location, open_store
    from rollout.storage.base import MetricRecord

    now = time.time()
    rows = [
        MetricRecord(run_id=run, step=step, name=name, value=value, time=now)
        for result in results
        for name, value in metric_names(result).items()
    ]
    store = open_store(store_location or default_store_location(), create=False)
    try:
        store.add_metrics(rows)
    finally:
        store.close()
    return len(rows)


# --- results and the report ----------------------------------------------------------------------


def _result(
    suite: _Suite, completions: list[list[str]] | None, scored: list[list[Score]]
) -> SuiteResult:
    spec = suite.spec
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
    settings: dict[str, Any] = {"samples": spec.samples, "limit": spec.limit}
    if suite.scorer.generates:
        settings |= {
            "max_new_tokens": suite.max_new_tokens,
            "temperature": suite.temperature,
            "top_p": suite.top_p,
        }
    return SuiteResult(
        name=spec.name,
        scorer=spec.scorer,
        data=suite.data,
        samples=spec.samples,
        ks=suite.ks,
        settings=settings,
        summary=summarize(rows, suite.ks),
        categories=by_category(rows, suite.ks),
        rows=records,
        plugin=suite.plugin,
    )


def _report(
    choice: ModelChoice, seed: int, templated: bool, results: list[SuiteResult], seconds: float
) -> dict[str, Any]:
    return {
        "format": REPORT_FORMAT,
        "model": choice.description,
        "model_fingerprint": choice.facts.fingerprint,
        "seed": seed,
        "chat_template": templated,
        "seconds": round(seconds, 3),
        "suites": [
            {
                "name": result.name,
                "scorer": result.scorer,
                "scorer_plugin": result.plugin,
                "data": result.data,
                "n": len(result.rows),
                "samples": result.samples,
                "k": result.ks,
                "settings": result.settings,
                "metrics": result.summary,
                "categories": {
                    name: {"n": count, "metrics": metrics}
                    for name, (count, metrics) in result.categories.items()
                },
                "rows": result.rows,
            }
            for result in results
        ],
    }


def _check_report(path: Path) -> None:
    if path.is_dir():
        raise RolloutError(Issue("--report", f"{path} is a directory", hint="name a .json file"))


def write_report(path: Path, report: dict[str, Any]) -> None:
    """The report as JSON, written whole or not at all (a temporary file, then renamed)."""
    path = Path(path)
    _check_report(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=1)
            file.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
