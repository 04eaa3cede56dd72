"""MMLU-style multiple choice, two ways: the answer letter a completion states ("Answer: C",
"(C)", "C."), or no generation at all: the choice whose text the model finds likeliest after the
prompt (summed log-probs of its tokens)."""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from typing import Any

LETTERS = string.ascii_uppercase

LogProb = Callable[[str, str], float]
"""(prompt, continuation) -> the summed log-probs of the continuation's tokens after the prompt."""


def letters_for(count: int) -> str:
    return LETTERS[:count]


def extract_letter(text: str, count: int) -> str | None:
    """The answer letter a completion gives among the first `count` letters, or None.

    In order of trust: a stated answer ("Answer: C", "the answer is (C)"; the last one wins, as
    a model may reason through others first); else the last parenthesized letter "(C)"; else a
    line that is a letter with a closing mark ("C.", "C)", "C:") or a letter alone ("C"). A
    capital letter inside prose ("A good guess") is never an answer.
    """
    valid = letters_for(count)
    if not valid:
        return None
    group = f"[{valid}]"
    stated = re.findall(
        rf"answer\s*(?:is|:)?\s*(?:option\s*)?[:\-]?\s*\(?({group})\)?(?![\w])",
        text,
        flags=re.IGNORECASE,
    )
    stated = [letter for letter in stated if letter in valid]  # IGNORECASE widened the group
    if stated:
        return stated[-1]
    parenthesized = re.findall(rf"\(({group})\)", text)
    if parenthesized:
        return parenthesized[-1]
    lines = re.findall(rf"^\s*({group})(?:[.):]|\s*$)", text, flags=re.MULTILINE)
    return lines[-1] if lines else None


def reference_letter(answer: Any, count: int) -> str | None:
    """A row's answer as a letter: "C", "c", "(C)" or the choice's 0-based index 2; None when it
    names no choice among `count`."""
    valid = letters_for(count)
    if isinstance(answer, int) and not isinstance(answer, bool):
        return valid[answer] if 0 <= answer < count else None
    if isinstance(answer, str):
        letter = answer.strip().strip("().").upper()
        return letter if len(letter) == 1 and letter in valid else None
    return None


def choose_by_loglik(
    prompt: str, choices: Sequence[str], logprob: LogProb
) -> tuple[int, list[float]]:
    """The index of the choice with the highest summed log-prob after `prompt` (the first on a
    tie), and every choice's log-prob."""
    if not choices:
        raise ValueError("choose_by_loglik: no choices")
    scores = [float(logprob(prompt, choice)) for choice in choices]
    best = max(range(len(scores)), key=lambda index: (scores[index], -index))
    return best, scores


def format_question(question: str, choices: Sequence[str]) -> str:
    """The usual MMLU prompt: the question, one lettered line per choice, then "Answer:"."""
    lines = [question.strip()]
    lines += [f"{letter}. {choice}" for letter, choice in zip(LETTERS, choices, strict=False)]
    lines.append("Answer:")
    return "\n".join(lines)
