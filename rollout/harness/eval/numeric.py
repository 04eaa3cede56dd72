"""GSM8K-style final numeric answers: the number right after the last "####" marker that has
one, else the last number in the text; thousands separators, a currency sign and a trailing
period are dropped, and numbers compare exactly ("1,000.00" equals 1000)."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

from rollout.harness.rewards import NUMBER, last_number

# GSM8K's own format: "#### 72" ends the worked answer. Only a number right after the marker
# ("#### $1,234.") counts; "#### There are 30 + 1 = 31" marks nothing.
_MARKED = re.compile(rf"####\s*\$?\s*({NUMBER.pattern})")


def final_number(text: str) -> Fraction | None:
    """The answer a completion gives: the number right after the last "####" that has one
    (whatever the working before it), else the last number written anywhere; None when there
    is none."""
    marked = _MARKED.findall(text)
    if marked:
        return Fraction(marked[-1].replace(",", ""))
    return last_number(text)


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
