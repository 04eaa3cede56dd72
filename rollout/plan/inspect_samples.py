"""Plan-time checks of the offline objectives' records: each must make a sample, within max_length.

The records are tokenized with the planned model's tokenizer (rollout.plan.tokenizer) by the very
rules the worker uses (rollout.plan.samples), so a record refused here would have failed the run,
and one accepted here fits. Without a tokenizer readable at plan time the worker checks instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.config.algorithm import ONLINE_KINDS
from rollout.config.root import RunConfig
from rollout.errors import Issue
from rollout.plan import tokenizer as plan_tokenizer
from rollout.plan.definition import ModelFacts
from rollout.plan.samples import Demonstration, Judged, Pair, SampleError, SampleRules


@dataclass(frozen=True)
class RecordProblem:
    """What is wrong with one record; the caller adds which record of which file."""

    path: str
    message: str
    hint: str | None = None


RecordCheck = Callable[[Mapping[str, Any]], list[RecordProblem]]


def sample_rules(config: RunConfig, tokenizer: Any) -> SampleRules:
    """The run's record -> token ids rules, for the planner's tokenizer or the worker's."""
    algo = config.algorithm
    return SampleRules(
        tokenizer=tokenizer,
        fields=config.data.fields.model_dump(),
        use_chat_template=config.data.use_chat_template,
        system_prompt=config.data.system_prompt,
        completion_only_loss=getattr(algo, "completion_only_loss", True),
    )


def record_check(
    config: RunConfig, model: ModelFacts | None, base_dir: Path
) -> tuple[RecordCheck | None, list[Issue]]:
    """The check to run on every record of an offline run, and problems of the run as a whole.

    Returns (None, issues) when there is nothing to check record by record: an online algorithm,
    a model that failed inspection, or no tokenizer readable without transformers.
    """
    kind = config.algorithm.kind
    if kind in ONLINE_KINDS or model is None:
        return None, []
    if config.data.use_chat_template and not model.chat_template:
        return None, [
            Issue(
                "data.use_chat_template",
                f"{kind} wraps prompts in the chat template, and the model has none",
                value=True,
                hint="set data.use_chat_template = false, or give model.chat_template",
            )
        ]
    tokenizer = plan_tokenizer.load(model, config.model, base_dir=base_dir)
    if tokenizer is None:
        return None, []
    rules = sample_rules(config, tokenizer)
    limit = config.algorithm.max_length
    fields = config.data.fields

    def check(record: Mapping[str, Any]) -> list[RecordProblem]:
        try:
            sample = rules.sample(kind, record)
        except SampleError as error:
            return [RecordProblem(f"data.fields.{error.role}", str(error), error.hint)]
        what, length = max(_lengths(sample, fields.model_dump()), key=lambda item: item[1])
        if length <= limit:
            return []
        return [
            RecordProblem(
                "algorithm.max_length",
                f"{what} is {length} tokens, longer than max_length {limit}",
                f"raise algorithm.max_length to at least {length}, or shorten or drop the record",
            )
        ]

    return check, []


def _lengths(
    sample: Pair | Judged | Demonstration, fields: dict[str, str | None]
) -> list[tuple[str, int]]:
    """(what, token count) of each sequence the sample becomes, naming the record's fields."""
    prompt = f"{fields['prompt']!r}"
    if isinstance(sample, Pair):
        return [
            (f"{prompt} + {fields['chosen']!r}", len(sample.prompt) + len(sample.chosen)),
            (f"{prompt} + {fields['rejected']!r}", len(sample.prompt) + len(sample.rejected)),
        ]
    if isinstance(sample, Judged):
        return [(f"{prompt} + {fields['completion']!r}", sample.length)]
    if fields.get("messages"):
        return [(f"{fields['messages']!r}", sample.length)]
    return [(f"{prompt} + {fields['completion']!r}", sample.length)]
