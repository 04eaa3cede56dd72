"""GSM8K-style final numeric answers: the number after the last "####" marker, else the last
number in the text; thousands separators, a currency sign and a trailing period are dropped,
and numbers compare exactly ("1,000.00" equals 1000)."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from rollout.harness.rewards import last_number

MARKER = "####"


def final_number(text: str) -> Fraction | None:
    """The answer a completion gives: after the last "####" when there is one (GSM8K's own
    format: what follows the marker is the answer, whatever the working before it), else the
    last number written anywhere; None when there is none."""
    if MARKER in text:
        return last_number(_first_number_text(text.rsplit(MARKER, 1)[1]))
    return last_number(text)


def _first_number_text(tail: str) -> str:
    """What follows the marker up to its end of line: "#### $1,234.\nThanks 5" -> "$1,234."."""
    return tail.strip().split("\n", 1)[0]


def reference_number(reference: Any) -> Fraction | None:
    """A data row's answer: a number, or text whose final number is taken (GSM8K's answers are
    their worked solution ending "#### 72")."""
    if isinstance(reference, bool):
        return None
    if isinstance(reference, int):
        return Fraction(reference)
    if isinstance(reference, float):
        return Fraction(str(reference)) if math.isfinite(reference) else None
    if isinstance(reference, str):
        return final_number(reference)
    return None


def normalized(number: Fraction) -> str:
    """One spelling per value, for majority votes: 1000, "1,000" and 1000.0 are all "1000"; a
    non-integer is its exact fraction ("7/2")."""
    return str(number)
