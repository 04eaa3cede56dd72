"""IFEval-style verifiable instructions: each row names its instructions as IFEval does, a list
of ids (``instruction_id_list``) with one kwargs object each (``kwargs``), and every one is
checked against the completion by a rule, not a judge.

The ids and kwarg names are IFEval's own (Zhou et al. 2023), so rows of its data set that use
this subset score as they are; ``punctuation:forbidden_characters`` is ours (IFEval has only
``punctuation:no_comma``). A kwarg whose value is null is left out first, since IFEval's
published rows carry every kwarg of every instruction, mostly null.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

RELATIONS = ("less than", "at least")
"""IFEval's comparisons: "less than" N is count < N, "at least" N is count >= N."""

_WORD = re.compile(r"\w+")
_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")
_BULLET = re.compile(r"^\s*[*-]\s", re.MULTILINE)
_FENCE = re.compile(r"^```(?:json|JSON)?\s*|\s*```$")


def _compare(count: int, relation: str, target: int) -> bool:
    return count < target if relation == "less than" else count >= target


def number_words(text: str, *, relation: str, num_words: int) -> bool:
    return _compare(len(_WORD.findall(text)), relation, num_words)


def number_sentences(text: str, *, relation: str, num_sentences: int) -> bool:
    return _compare(count_sentences(text), relation, num_sentences)


def count_sentences(text: str) -> int:
    """Runs of text ended by . ! or ? (then a space or the end), and a last unended one: "Hi. How
    are you? Fine" is 3; "3.5 is a number." is 1, a decimal point not being followed by a space."""
    pieces = _SENTENCE_END.split(text.strip())
    return sum(1 for piece in pieces if _WORD.search(piece))


def no_comma(text: str) -> bool:
    return "," not in text


def forbidden_characters(text: str, *, characters: str) -> bool:
    return not any(character in text for character in characters)


def forbidden_words(text: str, *, forbidden_words: list[str]) -> bool:
    return not any(_has_word(text, word) for word in forbidden_words)


def existence(text: str, *, keywords: list[str]) -> bool:
    return all(_has_word(text, word) for word in keywords)


def frequency(text: str, *, keyword: str, frequency: int, relation: str) -> bool:
    found = re.findall(rf"\b{re.escape(keyword)}\b", text, flags=re.IGNORECASE)
    return _compare(len(found), relation, frequency)


def json_format(text: str) -> bool:
    """The whole completion parses as JSON (a ```json fence around it is allowed, as IFEval
    allows it)."""
    try:
        json.loads(_FENCE.sub("", text.strip()))
    except ValueError:
        return False
    return True


def english_lowercase(text: str) -> bool:
    return text == text.lower() and any(c.isalpha() for c in text)


def english_capital(text: str) -> bool:
    return text == text.upper() and any(c.isalpha() for c in text)


def number_bullet_lists(text: str, *, num_bullets: int) -> bool:
    """Exactly `num_bullets` lines start with "* " or "- " (markdown bullets)."""
    return len(_BULLET.findall(text)) == num_bullets


def end_checker(text: str, *, end_phrase: str) -> bool:
    return text.strip().lower().endswith(end_phrase.strip().lower())


def quotation(text: str) -> bool:
    stripped = text.strip()
    return len(stripped) > 1 and stripped[0] == '"' and stripped[-1] == '"'


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", text, flags=re.IGNORECASE) is not None


@dataclass(frozen=True)
class Instruction:
    check: Callable[..., bool]
    kwargs: Mapping[str, type]
    """Every kwarg it needs, with its type (all are required)."""


INSTRUCTIONS: dict[str, Instruction] = {
    "length_constraints:number_words": Instruction(
        number_words, {"relation": str, "num_words": int}
    ),
    "length_constraints:number_sentences": Instruction(
        number_sentences, {"relation": str, "num_sentences": int}
    ),
    "punctuation:no_comma": Instruction(no_comma, {}),
    "punctuation:forbidden_characters": Instruction(forbidden_characters, {"characters": str}),
    "keywords:forbidden_words": Instruction(forbidden_words, {"forbidden_words": list}),
    "keywords:existence": Instruction(existence, {"keywords": list}),
    "keywords:frequency": Instruction(
        frequency, {"keyword": str, "frequency": int, "relation": str}
    ),
    "detectable_format:json_format": Instruction(json_format, {}),
    "detectable_format:number_bullet_lists": Instruction(number_bullet_lists, {"num_bullets": int}),
    "change_case:english_lowercase": Instruction(english_lowercase, {}),
    "change_case:english_capital": Instruction(english_capital, {}),
    "startend:end_checker": Instruction(end_checker, {"end_phrase": str}),
    "startend:quotation": Instruction(quotation, {}),
}


def instruction_problems(ids: Any, kwargs: Any) -> list[str]:
    """What is wrong with a row's instructions (empty when they can be checked): unknown ids,
    missing, unexpected or mistyped kwargs, an unknown relation."""
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        return ["'instruction_id_list' must be a non-empty list of instruction ids"]
    if not isinstance(kwargs, list) or len(kwargs) != len(ids):
        return [f"'kwargs' must be a list of {len(ids)} objects, one per instruction id"]
    problems = []
    for position, (name, given) in enumerate(zip(ids, kwargs, strict=True)):
        where = f"instruction {position} ({name})"
        instruction = INSTRUCTIONS.get(name)
        if instruction is None:
            problems.append(f"{where} is not one rollout checks; known: {', '.join(INSTRUCTIONS)}")
            continue
        if not isinstance(given, dict):
            problems.append(f"{where}: its kwargs must be an object")
            continue
        problems.extend(f"{where}: {problem}" for problem in _kwarg_problems(instruction, given))
    return problems


def _kwarg_problems(instruction: Instruction, given: dict[str, Any]) -> list[str]:
    present = {key: value for key, value in given.items() if value is not None}
    problems = [f"needs kwarg {key!r}" for key in instruction.kwargs if key not in present]
    problems += [f"takes no kwarg {key!r}" for key in present if key not in instruction.kwargs]
    for key, kind in instruction.kwargs.items():
        value = present.get(key)
        if value is None:
            continue
        if not isinstance(value, kind) or isinstance(value, bool):
            problems.append(f"kwarg {key!r} must be a {kind.__name__}, got {value!r}")
        elif key == "relation" and value not in RELATIONS:
            problems.append(f"kwarg 'relation' must be one of {RELATIONS}, got {value!r}")
    return problems


def followed(text: str, ids: list[str], kwargs: list[dict[str, Any]]) -> list[bool]:
    """Whether `text` follows each instruction (checked by instruction_problems first)."""
    results = []
    for name, given in zip(ids, kwargs, strict=True):
        present = {key: value for key, value in given.items() if value is not None}
        results.append(bool(INSTRUCTIONS[name].check(text, **present)))
    return results
