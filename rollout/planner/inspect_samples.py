"""Plan-time checks of every record a run reads, with the planned model's tokenizer.

Offline objectives (DPO, IPO, KTO, SFT, RM): each record must make a sample within
algorithm.max_length. Online algorithms (GRPO, RLOO, PPO, REINFORCE++): each prompt, chat template
and system prompt applied, must fit generation.max_prompt_tokens.

The records are tokenized with the planned model's tokenizer (rollout.planner.tokenizer) by the very
rules the worker uses (rollout.models.samples), so a record refused here would have failed the run,
and one accepted here fits. Every record of both splits is checked (up to data.*.limit, as the run
reads them). Without a tokenizer readable at plan time (see rollout.planner.tokenizer.load) there is
no such check: offline workers check their records before step 1, online prompts go unchecked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.config.algorithm import ONLINE_KINDS
from rollout.config.root import RunConfig
from rollout.errors import Issue
from rollout.models.facts import ModelFacts
from rollout.models.samples import Demonstration, Judged, Pair, SampleError, SampleRules
from rollout.planner import tokenizer as plan_tokenizer
from rollout.planner.openings import Opening, OpeningFailed


@dataclass(frozen=True)
class RecordProblem:
    """What is wrong with one record; the caller adds which record of which file.

    length: set when the record is longer than a limit (the config key at ``path``). Such
    problems are reported once per file and key, at the longest record, whose hint then names
    the limit that fits every record.
    """

    path: str
    message: str
    hint: str | None = None
    length: int | None = None


RecordCheck = Callable[[Mapping[str, Any]], list[RecordProblem]]


def sample_rules(config: RunConfig, tokenizer: Any) -> SampleRules:
    """The run's record -> token ids rules, for the planner's tokenizer or the worker's."""
    algo = config.algorithm
    # Only SFT's demonstrations may put prompt tokens in the loss; the other kinds score
    # completions alone, whatever the field would say.
    completion_only = algo.completion_only_loss if algo.kind == "sft" else True
    return SampleRules(
        tokenizer=tokenizer,
        fields=config.data.fields.model_dump(),
        use_chat_template=config.data.use_chat_template,
        system_prompt=config.data.system_prompt,
        completion_only_loss=completion_only,
    )


def record_check(
    config: RunConfig,
    model: ModelFacts | None,
    base_dir: Path,
    opening: Opening | None = None,
) -> tuple[RecordCheck | None, list[Issue]]:
    """The check to run on every record of the run, and problems of the run as a whole.
    `opening`: how an episode's environment opens it, in place of the prompt
    (rollout.planner.openings).

    Returns (None, issues) when there is nothing to check record by record: a model that failed
    inspection, no chat template where one is used, or no tokenizer readable without transformers.
    """
    kind = config.algorithm.kind
    if model is None:
        return None, []
    if config.data.use_chat_template and not model.chat_template:
        # Refused here for every kind: the worker could only refuse it at its first step.
        return None, [
            Issue(
                "data.use_chat_template",
                f"{kind} wraps prompts in the chat template, and the model has none",
                value=True,
                hint="set data.use_chat_template = false, or give model.chat_template",
            )
        ]
    try:
        tokenizer = plan_tokenizer.load(model, config.model, base_dir=base_dir)
    except plan_tokenizer.NoEndOfSequence:
        return None, [
            Issue(
                "model",
                "neither the model's config nor its tokenizer names an end-of-sequence token: "
                "no completion could ever end",
                hint="set eos_token_id in the model's config.json or generation_config.json, "
                "or eos_token in tokenizer_config.json",
            )
        ]
    if tokenizer is None or (config.data.use_chat_template and not tokenizer.has_chat_template):
        # The second: the tokenizer read here lacks the template the model's facts promise (a
        # GGUF's converted copy without one); the worker, which uses that copy, reports it.
        return None, []
    rules = sample_rules(config, tokenizer)
    if kind in ONLINE_KINDS:
        return _prompt_check(config, rules, model.context_length, opening), []
    return _sample_check(config, rules), []


def _sample_check(config: RunConfig, rules: SampleRules) -> RecordCheck:
    """An offline record must make a sample no longer than algorithm.max_length."""
    kind = config.algorithm.kind
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
                length=length,
            )
        ]

    return check


def _prompt_check(
    config: RunConfig, rules: SampleRules, context: int, opening: Opening | None
) -> RecordCheck:
    """An online prompt must fit generation.max_prompt_tokens, as the worker encodes it (an
    episode's as its environment opens it: after the tools' declarations, or the first
    observation a plugin environment's reset returns)."""
    limit = config.generation.max_prompt_tokens
    max_new = config.generation.max_new_tokens
    field = config.data.fields.prompt
    how = "with the chat template" if config.data.use_chat_template else "without a chat template"
    if config.data.use_chat_template and config.data.system_prompt is not None:
        how += " and the system prompt"
    opened = how if opening is None else f"{how} {opening.describe}"

    def check(record: Mapping[str, Any]) -> list[RecordProblem]:
        said = how
        if opening is not None and field in record:
            try:
                first = opening.first_message(record)
            except OpeningFailed as error:
                name = config.environment.name if config.environment else "environment"
                return [
                    RecordProblem(
                        "environment.name",
                        f"{name} cannot open an episode on this record: {error}",
                        "fix the environment's reset (try it: rollout plugins test "
                        f"{name} --kind environment --sample FILE), or drop the record",
                    )
                ]
            if first is not None:
                record, said = {**record, field: first}, opened
        try:
            length = len(rules.generation_prompt(record))
        except SampleError as error:
            return [RecordProblem(f"data.fields.{error.role}", str(error), error.hint)]
        if length <= limit:
            return []
        return [
            RecordProblem(
                "generation.max_prompt_tokens",
                f"prompt {field!r} is {length} tokens ({said}), longer than max_prompt_tokens "
                f"{limit}",
                _longer_prompt_hint(length, max_new, context),
                length=length,
            )
        ]

    return check


def _longer_prompt_hint(length: int, max_new: int, context: int) -> str:
    """What to change for a prompt of ``length`` tokens, within the model's context."""
    drop = "shorten or drop the record"
    if length + max_new <= context:
        return f"raise generation.max_prompt_tokens to at least {length}, or {drop}"
    if length < context:
        return (
            f"raise generation.max_prompt_tokens to at least {length} and lower "
            f"generation.max_new_tokens to at most {context - length} (the model's context is "
            f"{context} tokens), or {drop}"
        )
    return f"{drop}: it does not fit the model's context of {context} tokens"


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
