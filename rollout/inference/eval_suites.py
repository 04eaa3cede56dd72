"""Which suites `rollout eval` runs: from an eval config or from --suite and --data, with the
flags on top, each problem reported where it was written (the flag or the config's field). The
planner's checked_suites then reads and checks their rows, before any weights load."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from rollout.config.evaluation import SCORER_NAMES, EvalConfig, EvalSuite, suite_issues
from rollout.config.load import read_config_file
from rollout.config.validate import translate_errors
from rollout.errors import ConfigError, Issue, RolloutError, did_you_mean
from rollout.harness.eval.scorers import SCORERS
from rollout.planner.eval_suites import ChosenSuite

if TYPE_CHECKING:
    from rollout.inference.evaluate import EvalOptions

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


def read_eval_config(path: Path) -> EvalConfig:
    raw = read_config_file(path)
    try:
        config = EvalConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(
            translate_errors(exc, prefix=(), root=EvalConfig), source=str(path)
        ) from None
    unread = _unread_generation(config)
    if unread:
        raise ConfigError(unread, source=str(path))
    return config


def _unread_generation(config: EvalConfig) -> list[Issue]:
    """[generation] keys an eval does not read, when written: refused, never ignored."""
    written, issues = config.generation.model_fields_set, []
    if "max_prompt_tokens" in written:
        issues.append(
            Issue(
                "generation.max_prompt_tokens",
                "an eval never cuts its prompts: one that does not fit the model's context with "
                "its completion is refused, naming its row",
                hint="remove generation.max_prompt_tokens",
            )
        )
    if "gpu_memory_utilization" in written and config.generation.engine != "vllm":
        issues.append(
            Issue(
                "generation.gpu_memory_utilization",
                "only the vllm engine reserves a share of GPU memory; the hf engine ignores it",
                value=config.generation.gpu_memory_utilization,
                hint="remove it, or set generation.engine = 'vllm'",
            )
        )
    return issues


def chosen_suites(options: EvalOptions, config: EvalConfig | None) -> list[ChosenSuite]:
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
        suites.append(ChosenSuite(merged, data_base, base, where))
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


def _suite_from_flags(options: EvalOptions, given: dict[str, Any]) -> ChosenSuite:
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
    return ChosenSuite(suite, Path.cwd(), Path.cwd(), where)


def _samples(spec: EvalSuite) -> bool:
    builtin = SCORERS.get(spec.scorer)
    return builtin is None or builtin.generates  # a plugin scores completions


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
