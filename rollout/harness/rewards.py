"""Built-in reward functions: pure Python, batch-first, one signature.

Every reward is called as ``fn(prompts, completions, **fields, **options)`` and returns one float
per completion. ``fields`` are dataset fields as lists, one entry per completion (``answer=[...]``);
``options`` are the reward's ``options`` from the config, passed as plain keyword values.

The built-ins name exactly the fields and options they use and take no ``**kwargs``, so the plan
catches a misspelled option (``tolerence``) or a missing field (no ``answer`` in the data) before
step 1. The caller therefore passes a dataset field only to a function that names it (or takes
``**kwargs``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from rollout.harness.code_tests import code_tests

# A number as people and models write it (shared with the eval harness): optional minus (not a hyphen inside "3-5"), thousands
# separators only in groups of three ("1,234" but not "12,34"), optional decimals.
NUMBER = re.compile(
    r"(?:(?<![\w])-)?"
    r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+|(?=\.\d))"
    r"(?:\.\d+)?"
)

# Punctuation a sentence may end with; "50%" or "f(x)" keep their last character.
_TRAILING_PUNCTUATION = ".,;:!?"


def numeric_match(
    prompts: list[str],
    completions: list[str],
    *,
    answer: list[Any],
    tolerance: float = 0.0,
) -> list[float]:
    """1.0 where the last number in the completion equals the answer (within ``tolerance``).

    An answer may be an int, a float or a string; from a string its last number is taken, so a
    GSM8K-style "... #### 1,234" works as is. Numbers are compared exactly (as fractions of their
    decimal text), so 0.1 equals "0.1" and large integers do not lose digits.
    """
    if tolerance < 0:
        raise ValueError(f"numeric_match: tolerance must be >= 0, got {tolerance}")
    margin = _exact(tolerance)
    scores = []
    for completion, reference in zip(completions, answer, strict=True):
        got, expected = last_number(completion), _reference_number(reference)
        matched = got is not None and expected is not None and abs(got - expected) <= margin
        scores.append(1.0 if matched else 0.0)
    return scores


def exact_match(prompts: list[str], completions: list[str], *, answer: list[Any]) -> list[float]:
    """1.0 where completion and answer are equal after normalizing both (see ``normalize``)."""
    return [
        1.0 if normalize(str(completion)) == normalize(str(reference)) else 0.0
        for completion, reference in zip(completions, answer, strict=True)
    ]


def regex_match(
    prompts: list[str], completions: list[str], *, pattern: str, full: bool = False
) -> list[float]:
    """1.0 where ``pattern`` is found in the completion (``full=True``: matches all of it)."""
    compiled = re.compile(pattern)
    test = compiled.fullmatch if full else compiled.search
    return [1.0 if test(completion) else 0.0 for completion in completions]


def length_penalty(
    prompts: list[str], completions: list[str], *, target_chars: int, scale: float = 1.0
) -> list[float]:
    """``-scale * max(0, len - target_chars) / target_chars``: 0 up to the target, then linear."""
    if target_chars <= 0:
        raise ValueError(f"length_penalty: target_chars must be > 0, got {target_chars}")
    excess = [max(0, len(completion) - target_chars) for completion in completions]
    # 0.0 rather than -0.0 within the target, so logged rewards read plainly.
    return [-scale * over / target_chars if over else 0.0 for over in excess]


BUILTIN_REWARDS: dict[str, Callable[..., list[float]]] = {
    "numeric_match": numeric_match,
    "exact_match": exact_match,
    "regex_match": regex_match,
    "length_penalty": length_penalty,
    "code_tests": code_tests,
}


def last_number(text: str) -> Fraction | None:
    """The last number written in ``text``, exactly; None if there is none."""
    found = NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def normalize(text: str) -> str:
    """Casefold, collapse whitespace, drop trailing sentence punctuation: "The  Cat." -> "the cat"."""
    collapsed = " ".join(text.casefold().split())
    return collapsed.rstrip(_TRAILING_PUNCTUATION).rstrip()


def _reference_number(reference: Any) -> Fraction | None:
    if isinstance(reference, (int, float)):
        return _exact(reference) if math.isfinite(reference) else None
    if isinstance(reference, str):
        return last_number(reference)
    return None


def _exact(value: float) -> Fraction:
    # Through the decimal text, so the float 0.1 is 1/10 rather than its binary approximation.
    return Fraction(str(value))
