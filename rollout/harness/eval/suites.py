"""Running a checked eval suite: its prompts encoded, `samples` completions sampled per row (or,
for log-likelihood scoring, each choice scored in one forward pass), and every one scored.

What `rollout eval` and a training run's [[eval.suites]] both run. The suite comes checked (the
planner reads its rows and resolves its scorer); the engine, the model and the engine's sampling
parameters come from the caller, so nothing here knows a config or an engine.

Sampling is deterministic: chunk c of suite S is sampled with derive_seed(seed, "eval:S:c").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rollout.errors import Issue, RolloutError
from rollout.harness.eval.scorers import Score, Scorer, ScorerError
from rollout.models.prompts import encode_prompt, prompt_kind
from rollout.seeds import derive_seed

MAX_LISTED = 10


@dataclass(frozen=True)
class CheckedSuite:
    """A suite with its rows read and checked against its scorer, and every setting resolved."""

    name: str
    scorer: Scorer
    plugin: dict[str, Any] | None
    """A plugin scorer's identity (its module or file, version or sha256), for the report."""
    data: str
    rows: list[dict[str, Any]]
    places: list[str]
    """Where each row is in its file ("record 3 (line 4)"), for messages."""
    samples: int
    limit: int | None
    ks: list[int]
    temperature: float
    max_new_tokens: int
    top_p: float


class Generator(Protocol):
    """An engine as suites use it (rollout.engines.base.Engine): completions grouped by prompt,
    `n` each, with prompt_index, text and token_ids."""

    def generate(self, prompt_ids: list[list[int]], params: Any, /) -> Sequence[Any]: ...


@dataclass(frozen=True)
class Sampling:
    """How suites are sampled: `rollout eval`'s engine, or a training run's."""

    engine: Generator | None
    """None when no suite samples."""
    params: Callable[..., Any]
    """(max_new_tokens=, temperature=, top_p=, n=, seed=) -> the engine's sampling parameters;
    the caller binds the rest (top_k, stop), e.g. partial(SamplingParams, top_k=..., stop=...)."""
    batch_size: int
    seed: int


RowsDone = Callable[[int, int], None]
"""Progress: (rows done, new tokens sampled for them)."""


def run_suite(
    suite: CheckedSuite,
    prompt_ids: list[list[int]],
    sampling: Sampling,
    loaded: Any,
    on_rows: RowsDone | None = None,
) -> tuple[list[list[str]] | None, list[list[Score]]]:
    """One suite's completions (None when it samples nothing) and their scores, per row.
    `loaded` is a rollout.models.loading.LoadedModel (log-likelihood suites score with its
    model)."""
    on_rows = on_rows or (lambda rows_done, new_tokens: None)
    if suite.scorer.generates:
        completions = _sample(sampling, suite, prompt_ids, on_rows)
        return completions, _score_completions(suite, completions)
    return None, _score_choices(suite, prompt_ids, loaded, on_rows)


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
                        f"suite {suite.name}",
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
                        f"suite {suite.name}",
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
    sampling: Sampling, suite: CheckedSuite, prompt_ids: list[list[int]], on_rows: RowsDone
) -> list[list[str]]:
    """`samples` completion texts per row, in row order."""
    assert sampling.engine is not None  # the caller builds one when any suite samples
    n = suite.samples
    per_chunk = max(1, sampling.batch_size // n)  # a batch of completions, never part of a row's
    texts: list[list[str]] = [[] for _ in prompt_ids]
    for begin in range(0, len(prompt_ids), per_chunk):
        end = min(begin + per_chunk, len(prompt_ids))
        params = sampling.params(
            max_new_tokens=suite.max_new_tokens,
            temperature=suite.temperature,
            top_p=suite.top_p,
            n=n,
            seed=derive_seed(sampling.seed, f"eval:{suite.name}:{begin // per_chunk}"),
        )
        completions = sampling.engine.generate(prompt_ids[begin:end], params)
        for completion in completions:  # grouped by prompt, n each
            texts[begin + completion.prompt_index].append(completion.text)
        on_rows(end, sum(len(c.token_ids) for c in completions))
    return texts


def _score_completions(suite: CheckedSuite, completions: list[list[str]]) -> list[list[Score]]:
    scored = []
    for row, place, texts in zip(suite.rows, suite.places, completions, strict=True):
        try:
            scored.append([suite.scorer.score(row, text) for text in texts])
        except ScorerError as error:  # a plugin's failure; a built-in's would be rollout's bug
            raise RolloutError(
                Issue(
                    f"suite {suite.name}",
                    f"the scorer {suite.scorer.name} {error} on {place} of {suite.data}",
                    hint="fix the scorer; `rollout eval --limit N` reproduces it quickly",
                )
            ) from None
    return scored


def _score_choices(
    suite: CheckedSuite, prompt_ids: list[list[int]], loaded: Any, on_rows: RowsDone
) -> list[list[Score]]:
    """Log-likelihood scoring: each row's choices in one forward pass, no sampling."""
    from rollout.harness.eval.loglik import continuation_logprobs  # torch: only when scoring

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
        on_rows(number, 0)
    return scored


def _choice_ids(loaded: Any, text: str) -> list[int]:
    return list(loaded.tokenizer.encode(text, add_special_tokens=False))
