"""Eval suites checked before anything loads: each suite's scorer resolved (built-in, or a plugin
resolved as rewards are), its rows read and checked against it, its sampling settings resolved;
every problem in every suite reported together. `rollout eval` checks its suites so before any
weights load, and `rollout plan` a run's [[eval.suites]], freezing what was read in plan.lock
(file sha256, rows, the plugin's identity), so a changed suite file makes the plan stale."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from rollout.config.algorithm import ONLINE_KINDS
from rollout.config.evaluation import EvalSuite
from rollout.config.generation import GenerationSection
from rollout.config.root import RunConfig
from rollout.errors import Issue, RolloutError
from rollout.fingerprints import sha256_file
from rollout.harness.eval.scorers import SCORERS, FunctionScorer, Scorer
from rollout.harness.eval.suites import MAX_LISTED, CheckedSuite
from rollout.planner.definition import SuiteFacts
from rollout.planner.prompt_files import read_rows
from rollout.plugins.identity import PluginIdentity


@dataclass(frozen=True)
class ChosenSuite:
    """A suite to run, as written (with `rollout eval`'s flags applied), before its data is
    read."""

    spec: EvalSuite
    data_base: Path
    """Where a relative data path starts: the config's directory, or the current one (--data)."""
    plugin_base: Path
    """Where a './file.py:function' scorer starts: the config's directory."""
    where: Callable[[str], str]
    """Where to report a problem with one of its fields: the flag that set it, or its config
    path."""


ScorerResolver = Callable[[str, Path, str], tuple[Scorer, "dict[str, Any] | None"]]
"""(ref, base directory, used_by) -> the scorer and a plugin's identity: resolving it (`rollout
eval`, `rollout plan`), or loading what the plan resolved (a training worker)."""


def inspect_suites(config: RunConfig, base: Path, issues: list[Issue]) -> list[SuiteFacts]:
    """One record per suite of a run config; problems are added to `issues`, every suite's
    together."""
    if config.eval is None or config.algorithm.kind not in ONLINE_KINDS:
        return []  # an offline run with [eval] is refused by the config's rules
    try:
        suites = checked_suites(run_config_suites(config.eval.suites, base), config.generation)
    except RolloutError as error:
        issues.extend(error.issues)
        return []
    return [
        SuiteFacts(
            name=suite.name,
            location=suite.data,
            num_records=len(suite.rows),
            fingerprint=sha256_file(suite.data),
            scorer_plugin=PluginIdentity.model_validate(suite.plugin) if suite.plugin else None,
        )
        for suite in suites
    ]


def run_config_suites(suites: list[EvalSuite], base: Path) -> list[ChosenSuite]:
    """A run config's [[eval.suites]] as suites to check and run: paths relative to the run
    config's directory, problems reported at eval.suites[N].<field>."""

    def where(key: str, index: int) -> str:
        return f"eval.suites[{index}].{key}"

    return [
        ChosenSuite(spec, base, base, partial(where, index=index))
        for index, spec in enumerate(suites)
    ]


def resolve_scorer(ref: str, base_dir: Path, used_by: str) -> tuple[Scorer, dict[str, Any] | None]:
    """A built-in scorer by name, or a plugin resolved as rewards are (module, file or entry
    point in the group rollout.scorers), with its identity."""
    if ref in SCORERS:
        return SCORERS[ref], None
    from rollout.plugins.registry import SCORER_GROUP
    from rollout.plugins.resolve import resolve_plugin

    resolved = resolve_plugin(
        ref,
        base_dir=base_dir,
        used_by=used_by,
        group=SCORER_GROUP,
        builtins={name: scorer.score for name, scorer in SCORERS.items()},
    )
    return FunctionScorer(ref, resolved.fn), resolved.identity.model_dump(mode="json")


def checked_suites(
    specs: list[ChosenSuite],
    generation: GenerationSection,
    resolve: ScorerResolver = resolve_scorer,
) -> list[CheckedSuite]:
    """Each suite's rows read and checked against its scorer, and its sampling settings
    resolved; every problem in every suite is reported together."""
    issues: list[Issue] = []
    suites = []
    for chosen in specs:
        spec, where = chosen.spec, chosen.where
        try:
            scorer, plugin = resolve(spec.scorer, chosen.plugin_base, where("scorer"))
        except RolloutError as error:
            issues.extend(error.issues)
            continue
        temperature = first(spec.temperature, 0.0 if spec.samples == 1 else generation.temperature)
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
            CheckedSuite(
                name=spec.name,
                scorer=scorer,
                plugin=plugin,
                data=rows.location,
                rows=rows.records,
                places=rows.places or [],
                samples=spec.samples,
                limit=spec.limit,
                ks=sorted(set(spec.k)) if spec.k else sorted({1, spec.samples}),
                temperature=temperature,
                max_new_tokens=first(spec.max_new_tokens, generation.max_new_tokens),
                top_p=first(spec.top_p, generation.top_p),
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


def first(*values: Any) -> Any:
    """The first value that is not None (a flag, else the config's, else a default)."""
    return next((value for value in values if value is not None), None)
