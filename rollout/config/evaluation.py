"""An eval config (`rollout eval --config eval.toml`): the model, base generation settings and
one or more suites, each a scorer over a data file.

    [model]                      # as in a run config (or --model / --checkpoint)
    builtin = "tiny-llama"

    [generation]                 # as in a run config: the base for every suite
    max_new_tokens = 64

    [[suites]]
    name = "gsm8k-mini"
    scorer = "gsm8k"
    data = "data/gsm8k-mini.jsonl"   # relative to this file
    samples = 4
    k = [1, 4]
    temperature = 0.8

A separate file from a run config (its own top level), validated strictly like one: an unknown
key is refused. The checks across fields live in `suite_issues`, run again after `rollout eval`'s
flags are applied, so a flag that breaks a rule is named as the flag.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from pydantic import AfterValidator, Field

from rollout.config.base import ConfigModel
from rollout.config.generation import GenerationSection
from rollout.config.model import ModelSection
from rollout.config.rewards import check_plugin_ref
from rollout.errors import Issue

SCORER_NAMES = ("gsm8k", "ifeval", "mmlu", "mmlu_loglik")
"""The built-in scorers (rollout.harness.eval.scorers.SCORERS; a test keeps the two equal)."""

ScorerRef = Annotated[
    str,
    AfterValidator(check_plugin_ref),
    Field(examples=["gsm8k", "my_pkg.scorers:score", "./scorers.py:score"]),
]


class EvalSuite(ConfigModel):
    name: str = Field(
        pattern=r"^[A-Za-z0-9_.-]+$",
        max_length=64,
        description="The suite's name in the table, the report and run-store metrics "
        "(eval/<name>/<score>): letters, digits, '_', '.', '-'.",
    )
    scorer: ScorerRef = Field(
        description="How completions are scored: 'gsm8k' (final number equals 'answer'), "
        "'ifeval' (the row's 'instruction_id_list' and 'kwargs' are followed), 'mmlu' (the "
        "stated letter is 'answer'), 'mmlu_loglik' (the likeliest of 'choices' is 'answer'; "
        "samples nothing), or a plugin: 'package.module:function' or './file.py:function' "
        "(relative to this config), called as fn(row, completion) -> a score in [0, 1]."
    )
    data: str = Field(
        min_length=1,
        description="JSONL or Parquet file of rows: a path relative to this config's directory, "
        "or an fsspec URL.",
    )
    samples: int = Field(
        default=1, ge=1, le=1024, description="Completions sampled per row (n of pass@k)."
    )
    k: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list,
        description="The k of pass@k and maj@k, each at most samples. Empty: 1 and samples.",
    )
    max_new_tokens: int | None = Field(
        default=None, ge=1, description="Most tokens per completion. None: [generation]'s."
    )
    temperature: float | None = Field(
        default=None,
        ge=0,
        description="Sampling temperature. None: 0 (greedy) with one sample, [generation]'s "
        "with more (more samples at temperature 0 are refused: they would all be the same).",
    )
    top_p: float | None = Field(
        default=None, gt=0, le=1, description="Nucleus sampling mass. None: [generation]'s."
    )
    limit: int | None = Field(default=None, ge=1, description="Only the first N rows.")


class EvalConfig(ConfigModel):
    model: ModelSection | None = Field(
        default=None,
        description="The model, as a run config's [model]; --model or --checkpoint replace it.",
    )
    generation: GenerationSection = Field(
        default_factory=GenerationSection,
        description="Generation settings, as a run config's [generation]; each suite may "
        "override max_new_tokens, temperature and top_p.",
    )
    seed: int = Field(default=0, ge=0, description="Sampling seed; each suite derives its own.")
    suites: list[EvalSuite] = Field(min_length=1, description="The suites to run, in order.")


class EvalSection(ConfigModel):
    """[eval] in a run config: suites the trainer runs on the policy as it trains, at step 0,
    every run.eval_interval steps and at the last step, recorded as eval/<suite>/<score>."""

    suites: list[EvalSuite] = Field(
        min_length=1,
        description="The suites to run, in order, with the keys of an eval config's [[suites]]; "
        "data paths are relative to the run config. Online algorithms only.",
    )


def suite_issues(suite: EvalSuite, where: Callable[[str], str]) -> list[Issue]:
    """What is wrong across a suite's fields; `where(field)` names the place to report it (the
    config path, or the flag that set it)."""
    issues = []
    too_large = [k for k in suite.k if k > suite.samples]
    if too_large:
        issues.append(
            Issue(
                where("k"),
                f"pass@k and maj@k need k <= samples ({suite.samples}): k = "
                f"{', '.join(map(str, too_large))} is more than the samples drawn",
                value=list(suite.k),
                hint=f"raise samples to {max(too_large)} or lower k",
            )
        )
    if suite.scorer == "mmlu_loglik":
        if suite.samples != 1:
            issues.append(
                Issue(
                    where("samples"),
                    "mmlu_loglik scores the choices' log-likelihood and samples nothing: "
                    "samples must be 1",
                    value=suite.samples,
                    hint="use scorer 'mmlu' to sample answers and extract their letters",
                )
            )
        for key in ("max_new_tokens", "temperature", "top_p"):
            if getattr(suite, key) is not None:
                issues.append(
                    Issue(where(key), "means nothing for mmlu_loglik, which samples nothing")
                )
    return issues
