"""The built-in scorers, by name, behind one interface.

A scorer says which fields a data row needs (``problems``: every missing or malformed field,
named, so a bad row is reported before any weights load), what prompt to send (``prompt``), and
how good one completion is (``score``). A scorer with ``generates = False`` samples nothing: it
scores a row with a log-prob callable instead (``score_choices``).

Every row may name a ``category`` (e.g. an MMLU subject), for per-category scores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from rollout.harness.eval import choice, ifeval, numeric

CATEGORY = "category"


@dataclass(frozen=True)
class Score:
    value: float
    """In [0, 1]."""
    correct: bool
    """Fully right: what pass@k counts."""
    answer: str | None
    """The normalized answer given, for maj@k; None when none was found (or there is none)."""


class Scorer:
    name: ClassVar[str]
    generates: ClassVar[bool] = True
    votes: ClassVar[bool] = True
    """Whether completions give answers to take a majority vote over (maj@k)."""

    def problems(self, record: dict[str, Any]) -> list[tuple[str, str]]:
        """(field, what is wrong) for each field this row lacks or holds wrongly."""
        found = self._problems(record)
        category = record.get(CATEGORY)
        if category is not None and not isinstance(category, str):
            found.append((CATEGORY, f"must be text, got {category!r}"))
        return found

    def _problems(self, record: dict[str, Any]) -> list[tuple[str, str]]:
        return _prompt_problems(record)

    def prompt(self, record: dict[str, Any]) -> str | list[dict[str, Any]]:
        return record["prompt"]

    def score(self, record: dict[str, Any], completion: str) -> Score:
        raise NotImplementedError


class FinalNumber(Scorer):
    """GSM8K: the completion's final number equals the row's ``answer``."""

    name = "gsm8k"

    def _problems(self, record):
        found = _prompt_problems(record)
        if "answer" not in record:
            found.append(
                ("answer", "missing: the reference answer (a number, or text ending in one)")
            )
        elif numeric.reference_number(record["answer"]) is None:
            found.append(("answer", f"holds no number: {record['answer']!r}"))
        return found

    def score(self, record, completion):
        got = numeric.final_number(completion)
        right = got is not None and got == numeric.reference_number(record["answer"])
        answer = numeric.normalized(got) if got is not None else None
        return Score(1.0 if right else 0.0, right, answer)


class Instructions(Scorer):
    """IFEval: value is the share of the row's instructions followed (instruction-level
    accuracy); correct when every one is (prompt-level strict accuracy)."""

    name = "ifeval"
    votes = False

    def _problems(self, record):
        found = _prompt_problems(record)
        for key in ("instruction_id_list", "kwargs"):
            if key not in record:
                found.append((key, "missing: IFEval rows list instruction ids and their kwargs"))
        if not found:
            problems = ifeval.instruction_problems(record["instruction_id_list"], record["kwargs"])
            found += [("instruction_id_list", problem) for problem in problems]
        return found

    def score(self, record, completion):
        results = ifeval.followed(completion, record["instruction_id_list"], record["kwargs"])
        return Score(sum(results) / len(results), all(results), None)


class ChoiceLetter(Scorer):
    """MMLU by generation: the letter the completion states is the row's ``answer``. The prompt
    is the row's ``prompt``, else its ``question`` with lettered ``choices`` and "Answer:"."""

    name = "mmlu"

    def _problems(self, record):
        found = []
        if "prompt" in record:
            found += _prompt_problems(record)
        elif not isinstance(record.get("question"), str):
            found.append(("question", "missing: an MMLU row needs 'question' (or 'prompt')"))
        choices = record.get("choices")
        if not _is_choice_list(choices):
            found.append(("choices", "must be a list of at least 2 texts"))
        elif "answer" not in record:
            found.append(("answer", "missing: the right choice's letter or 0-based index"))
        elif choice.reference_letter(record["answer"], len(choices)) is None:
            letters = choice.letters_for(len(choices))
            found.append(
                (
                    "answer",
                    f"must be one of {', '.join(letters)} or 0..{len(choices) - 1}, "
                    f"got {record['answer']!r}",
                )
            )
        return found

    def prompt(self, record):
        if "prompt" in record:
            return record["prompt"]
        return choice.format_question(record["question"], record["choices"])

    def score(self, record, completion):
        count = len(record["choices"])
        got = choice.extract_letter(completion, count)
        right = got is not None and got == choice.reference_letter(record["answer"], count)
        return Score(1.0 if right else 0.0, right, got)


class ChoiceLoglik(ChoiceLetter):
    """MMLU by log-likelihood: no sampling; the choice whose text is likeliest after the prompt
    is the model's answer."""

    name = "mmlu_loglik"
    generates = False
    votes = False

    def score(self, record, completion):
        raise TypeError("mmlu_loglik samples nothing: call score_choices")

    def score_choices(self, record: dict[str, Any], logprob: choice.LogProb) -> Score:
        prompt = self.prompt(record)
        best, _ = choice.choose_by_loglik(prompt, [f" {c}" for c in record["choices"]], logprob)
        letter = choice.letters_for(len(record["choices"]))[best]
        right = letter == choice.reference_letter(record["answer"], len(record["choices"]))
        return Score(1.0 if right else 0.0, right, letter)


class ScorerError(Exception):
    """A plugin scorer raised, or returned something that is not a score."""


class ScorerFn(Protocol):
    """A scorer plugin: what ``[[eval.suites]] scorer`` names when it is not a built-in. Given a
    row and one completion, a score in [0, 1] (a bool counts as 0 or 1); 1 is correct."""

    def __call__(self, record: dict[str, Any], completion: str) -> float | bool: ...


class FunctionScorer(Scorer):
    """A plugin scorer: ``fn(row, completion)`` returns a score in [0, 1] (a bool is 0 or 1);
    the completion is correct when it is 1. It gives no answers to vote on (no maj@k). Rows
    need a ``prompt``; whatever else the function reads is its own business."""

    votes = False

    def __init__(self, name: str, fn: Callable[[dict[str, Any], str], Any]):
        self.name = name  # type: ignore[misc]  # the reference it was loaded from
        self.fn = fn

    def score(self, record, completion):
        try:
            value = self.fn(record, completion)
        except Exception as error:  # the plugin's failure, reported with the row it failed on
            raise ScorerError(f"raised {type(error).__name__}: {error}") from error
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
            raise ScorerError(f"returned {value!r}, not a score in [0, 1] (or a bool)")
        return Score(float(value), value == 1.0, None)


SCORERS: dict[str, Scorer] = {
    scorer.name: scorer
    for scorer in (FinalNumber(), Instructions(), ChoiceLetter(), ChoiceLoglik())
}


def _prompt_problems(record: dict[str, Any]) -> list[tuple[str, str]]:
    value = record.get("prompt")
    if value is None:
        return [("prompt", "missing: the text (or chat messages) to send the model")]
    if isinstance(value, str) and value.strip():
        return []
    if (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value
        )
    ):
        return []
    return [("prompt", "must be non-empty text or a list of {role, content} chat messages")]


def _is_choice_list(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) >= 2
        and all(isinstance(item, str) for item in value)
    )
