"""Small synthetic datasets for examples and tests, generated deterministically from a seed.

The committed files under examples/data/ are this module's output; a test regenerates them and
checks they match, so they never drift from the code. Regenerate with
``python -m rollout.testing.datasets examples/data``.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

Record = dict[str, object]


def _operands(count: int, seed: int, low: int = 1, high: int = 99) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(low, high), rng.randint(low, high)) for _ in range(count)]


def _question(a: int, b: int) -> str:
    return f"What is {a} + {b}? Answer with just the number."


def addition(count: int, *, seed: int) -> list[Record]:
    """Integer addition questions with numeric answers (for GRPO/PPO with numeric_match)."""
    return [{"prompt": _question(a, b), "answer": str(a + b)} for a, b in _operands(count, seed)]


def preference_pairs(count: int, *, seed: int) -> list[Record]:
    """Addition questions with the right answer preferred over a near miss (DPO/IPO/RM)."""
    rng = random.Random(seed)
    records = []
    for a, b in _operands(count, seed):
        wrong = a + b + rng.choice([-10, -2, -1, 1, 2, 10])
        records.append({"prompt": _question(a, b), "chosen": str(a + b), "rejected": str(wrong)})
    return records


def glued_pairs(count: int, *, seed: int) -> list[Record]:
    """The sum preferred over the operands glued together ("31 + 76" -> "3176"), a failure of
    small models that a tiny one can learn to disprefer (DPO/IPO/KTO/RM smoke runs)."""
    return [
        {"prompt": _question(a, b), "chosen": str(a + b), "rejected": f"{a}{b}"}
        for a, b in _operands(count, seed, low=10)
    ]


def judged_answers(count: int, *, seed: int) -> list[Record]:
    """Unpaired answers with a desirable label (KTO): the sum (true) or the glued operands
    (false), half and half at random."""
    rng = random.Random(seed)
    records = []
    for pair in glued_pairs(count, seed=seed):
        good = rng.random() < 0.5
        completion = pair["chosen"] if good else pair["rejected"]
        records.append({"prompt": pair["prompt"], "completion": completion, "label": good})
    return records


def demonstrations(count: int, *, seed: int) -> list[Record]:
    """Addition questions with worked answers (SFT)."""
    return [
        {"prompt": _question(a, b), "completion": f"{a} + {b} = {a + b}. The answer is {a + b}."}
        for a, b in _operands(count, seed)
    ]


def word_problems(count: int, *, seed: int) -> list[Record]:
    """GSM8K-style rows (`rollout eval` suite gsm8k): a short word problem, its worked answer
    ending "#### N" as GSM8K writes it, and a category."""
    rng = random.Random(seed)
    records = []
    for a, b in _operands(count, seed, low=2, high=40):
        if rng.random() < 0.5:
            prompt = f"Ana has {a} apples and buys {b} more. How many apples does she have?"
            answer, category = f"{a} + {b} = {a + b}\n#### {a + b}", "addition"
        else:
            prompt = f"A box holds {a} pens. How many pens do {b} boxes hold?"
            answer, category = f"{a} * {b} = {a * b}\n#### {a * b:,}", "multiplication"
        records.append(
            {
                "prompt": f"{prompt} Finish with '#### ' and the number.",
                "answer": answer,
                "category": category,
            }
        )
    return records


_INSTRUCTIONS: list[tuple[str, list[str], list[Record]]] = [
    (
        "Describe the sea in fewer than 40 words, all in lower case.",
        ["length_constraints:number_words", "change_case:english_lowercase"],
        [{"relation": "less than", "num_words": 40}, {}],
    ),
    (
        "Give a JSON object with the keys name and age for a made-up person.",
        ["detectable_format:json_format"],
        [{}],
    ),
    (
        "List three fruits as markdown bullet points, without using commas.",
        ["detectable_format:number_bullet_lists", "punctuation:no_comma"],
        [{"num_bullets": 3}, {}],
    ),
    (
        "Write two sentences about rain that mention clouds, and end with 'That is all.'",
        ["keywords:existence", "startend:end_checker", "length_constraints:number_sentences"],
        [
            {"keywords": ["clouds"]},
            {"end_phrase": "That is all."},
            {"relation": "less than", "num_sentences": 4},
        ],
    ),
    (
        "SHOUT A GREETING IN CAPITAL LETTERS, WITHOUT THE WORD HELLO.",
        ["change_case:english_capital", "keywords:forbidden_words"],
        [{}, {"forbidden_words": ["hello"]}],
    ),
    (
        "Name a colour without using the characters '!' or '?'.",
        ["punctuation:forbidden_characters"],
        [{"characters": "!?"}],
    ),
]


def instruction_rows(count: int, *, seed: int) -> list[Record]:
    """IFEval-style rows (`rollout eval` suite ifeval): a prompt, its instruction ids and
    kwargs, in IFEval's layout."""
    rng = random.Random(seed)
    return [
        {"prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs}
        for prompt, ids, kwargs in (rng.choice(_INSTRUCTIONS) for _ in range(count))
    ]


def multiple_choice(count: int, *, seed: int) -> list[Record]:
    """MMLU-style rows (`rollout eval` suites mmlu and mmlu_loglik): a question, four choices,
    the right one's letter and a category."""
    rng = random.Random(seed)
    records = []
    for a, b in _operands(count, seed, low=2, high=20):
        plus = rng.random() < 0.5
        right = a + b if plus else a * b
        wrong = {right + 1, right - 1, right + 10, abs(right - a), right + b} - {right}
        choices = [str(c) for c in rng.sample(sorted(wrong), 3)] + [str(right)]
        rng.shuffle(choices)
        records.append(
            {
                "question": f"What is {a} {'+' if plus else '*'} {b}?",
                "choices": choices,
                "answer": "ABCD"[choices.index(str(right))],
                "category": "addition" if plus else "multiplication",
            }
        )
    return records


def example_files() -> Iterator[tuple[str, list[Record]]]:
    """Every committed example data file, by name. Train and eval use different seeds."""
    yield "arith-train.jsonl", addition(1000, seed=1)
    yield "arith-eval.jsonl", addition(200, seed=2)
    yield "prefs-train.jsonl", preference_pairs(256, seed=3)
    yield "prefs-eval.jsonl", preference_pairs(64, seed=4)
    yield "sft-train.jsonl", demonstrations(256, seed=5)
    yield "sft-eval.jsonl", demonstrations(64, seed=6)
    yield "glued-train.jsonl", glued_pairs(256, seed=7)
    yield "glued-eval.jsonl", glued_pairs(64, seed=8)
    yield "judged-train.jsonl", judged_answers(256, seed=9)
    yield "judged-eval.jsonl", judged_answers(64, seed=10)
    yield "eval-gsm8k.jsonl", word_problems(24, seed=11)
    yield "eval-ifeval.jsonl", instruction_rows(12, seed=12)
    yield "eval-mmlu.jsonl", multiple_choice(24, seed=13)


def to_jsonl(records: list[Record]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def write_example_files(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, records in example_files():
        (directory / name).write_text(to_jsonl(records), encoding="utf-8")


if __name__ == "__main__":
    write_example_files(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/data"))
