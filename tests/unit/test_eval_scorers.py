"""The eval scorers on hand-written completions: what each must extract, and what must score 0."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from rollout.harness.eval import choice, ifeval, numeric
from rollout.harness.eval.scorers import SCORERS, Score

# --- GSM8K ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She has 3 apples, then 4 more: 7", Fraction(7)),
        ("Working: 2 + 3 = 5.\n#### 72", Fraction(72)),
        ("#### $1,234.", Fraction(1234)),
        ("The total is $1,234.50.", Fraction("1234.5")),
        ("#### 1,000.00\nAnything after: 9", Fraction(1000)),  # the marker's number wins
        ("It drops to -5 degrees.", Fraction(-5)),
        ("The answer is 0.5", Fraction(1, 2)),
        ("no number here", None),
        ("#### nothing", None),
        ("The answer is 7.\n####", Fraction(7)),  # a marker with no number marks nothing
        ("#### There are 30 + 1 = 31 pens", Fraction(31)),  # nor does one before words
        ("#### 12\nthen #### 15\n####", Fraction(15)),  # the last marker with a number
        ("#### $-4.50", Fraction("-4.5")),
    ],
)
def test_final_number(text, expected):
    assert numeric.final_number(text) == expected


def test_gsm8k_compares_numerically_and_normalizes_answers():
    scorer = SCORERS["gsm8k"]
    row = {"prompt": "q", "answer": "Natalia sold 48 + 24 = 72 clips.\n#### 72"}
    assert scorer.score(row, "So 72.").correct
    assert scorer.score(row, "#### 72.00").answer == "72"
    assert scorer.score({"prompt": "q", "answer": 1000}, "It costs $1,000.").correct
    assert scorer.score({"prompt": "q", "answer": 0.1}, "0.10").correct
    wrong = scorer.score(row, "72 is close, but it is 73")
    assert (wrong.value, wrong.correct, wrong.answer) == (0.0, False, "73")
    nothing = scorer.score(row, "I do not know")
    assert (nothing.value, nothing.correct, nothing.answer) == (0.0, False, None)


def test_gsm8k_names_bad_rows():
    scorer = SCORERS["gsm8k"]
    assert scorer.problems({"prompt": "q", "answer": "7"}) == []
    assert [f for f, _ in scorer.problems({"prompt": "q"})] == ["answer"]
    assert [f for f, _ in scorer.problems({"answer": 3})] == ["prompt"]
    assert [f for f, _ in scorer.problems({"prompt": "q", "answer": "seven"})] == ["answer"]
    assert [f for f, _ in scorer.problems({"prompt": "q", "answer": 1, "category": 3})] == [
        "category"
    ]


# --- IFEval --------------------------------------------------------------------------------------


def _follows(name, text, **kwargs):
    assert ifeval.instruction_problems([name], [kwargs]) == []
    return ifeval.followed(text, [name], [kwargs])[0]


def test_word_and_sentence_counts():
    words = "length_constraints:number_words"
    assert _follows(words, "one two three", relation="at least", num_words=3)
    assert not _follows(words, "one two", relation="at least", num_words=3)
    assert _follows(words, "one two", relation="less than", num_words=3)
    assert not _follows(words, "one two three", relation="less than", num_words=3)
    sentences = "length_constraints:number_sentences"
    text = "Hi there. How are you? Pi is 3.14 today! Fine"
    assert ifeval.count_sentences(text) == 4
    assert _follows(sentences, text, relation="at least", num_sentences=4)
    assert not _follows(sentences, text, relation="less than", num_sentences=4)


def test_forbidden_characters_and_words():
    assert _follows("punctuation:no_comma", "no commas here")
    assert not _follows("punctuation:no_comma", "a, b")
    chars = "punctuation:forbidden_characters"
    assert _follows(chars, "plain text", characters="!?")
    assert not _follows(chars, "what?", characters="!?")
    words = "keywords:forbidden_words"
    assert _follows(words, "a catalogue of things", forbidden_words=["cat"])  # a word, not a part
    assert not _follows(words, "The Cat sat", forbidden_words=["dog", "cat"])


def test_keywords_and_frequency():
    assert _follows("keywords:existence", "Rust and Python", keywords=["python", "rust"])
    assert not _follows("keywords:existence", "only Python", keywords=["python", "rust"])
    freq = "keywords:frequency"
    assert _follows(freq, "go go go", keyword="go", frequency=3, relation="at least")
    assert not _follows(freq, "go go", keyword="go", frequency=3, relation="at least")


def test_json_case_bullets_endings():
    assert _follows("detectable_format:json_format", '{"a": [1, 2]}')
    assert _follows("detectable_format:json_format", '```json\n{"a": 1}\n```')
    assert not _follows("detectable_format:json_format", 'Here it is: {"a": 1}')
    assert _follows("change_case:english_lowercase", "all quiet here.")
    assert not _follows("change_case:english_lowercase", "Not quiet")
    assert not _follows("change_case:english_lowercase", "123")  # nothing to be lower case
    assert _follows("change_case:english_capital", "LOUD, 2 TIMES")
    assert not _follows("change_case:english_capital", "LOUD but not")
    bullets = "detectable_format:number_bullet_lists"
    assert _follows(bullets, "Items:\n* one\n- two\n  * three", num_bullets=3)
    assert not _follows(bullets, "* one\n* two", num_bullets=3)
    assert not _follows(bullets, "*bold* is not a bullet", num_bullets=1)
    ends = "startend:end_checker"
    assert _follows(ends, "Done. Any other questions?  ", end_phrase="Any other questions?")
    assert not _follows(ends, "Any other questions? Bye", end_phrase="Any other questions?")
    assert _follows("startend:quotation", '"quoted"')
    assert not _follows("startend:quotation", '"half')


def test_ifeval_row_scores_share_followed_and_all_followed():
    scorer = SCORERS["ifeval"]
    row = {
        "prompt": "Write in lower case, at least 3 words, no commas.",
        "instruction_id_list": [
            "change_case:english_lowercase",
            "length_constraints:number_words",
            "punctuation:no_comma",
        ],
        # IFEval's published rows carry every kwarg, mostly null: nulls are dropped.
        "kwargs": [{"num_words": None}, {"relation": "at least", "num_words": 3}, {}],
    }
    assert scorer.problems(row) == []
    full = scorer.score(row, "three small words")
    assert (full.value, full.correct, full.answer) == (1.0, True, None)
    partial = scorer.score(row, "Three, small")
    assert partial.value == pytest.approx(0.0) and not partial.correct
    two_of_three = scorer.score(row, "three small, words")
    assert two_of_three.value == pytest.approx(2 / 3) and not two_of_three.correct


@pytest.mark.parametrize(
    ("ids", "kwargs", "said"),
    [
        (["no:such"], [{}], "is not one rollout checks"),
        (
            ["length_constraints:number_words"],
            [{"relation": "at least"}],
            "needs kwarg 'num_words'",
        ),
        (["punctuation:no_comma"], [{"typo": 1}], "takes no kwarg 'typo'"),
        (["length_constraints:number_words"], [{"relation": "more", "num_words": 3}], "relation"),
        (["length_constraints:number_words"], [{"relation": "at least", "num_words": "3"}], "int"),
        (["punctuation:no_comma"], [], "one per instruction"),
        ([], [], "non-empty list"),
    ],
)
def test_ifeval_bad_instructions_are_named(ids, kwargs, said):
    problems = ifeval.instruction_problems(ids, kwargs)
    assert problems and said in " ".join(problems)


# --- MMLU ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Answer: C", "C"),
        ("The answer is (B).", "B"),
        ("Let me think: A seems wrong, (D) fits.", "D"),
        ("C. Because it is", "C"),
        ("I pick\nB)\n", "B"),
        ("B", "B"),
        ("Answer: A. Wait, no. Final answer: D", "D"),  # the last stated answer
        ("A good guess is hard", None),  # an article, not an answer
        ("It is between A and B", None),
        ("Answer: E", None),  # no such choice among four
        ("answer: c", None),  # a lower-case letter is prose
        ("", None),
    ],
)
def test_extract_letter(text, expected):
    assert choice.extract_letter(text, 4) == expected


def test_mmlu_rows_prompt_and_reference():
    scorer = SCORERS["mmlu"]
    row = {"question": "2 + 2 =", "choices": ["3", "4", "5", "6"], "answer": 1}
    assert scorer.problems(row) == []
    assert scorer.prompt(row) == "2 + 2 =\nA. 3\nB. 4\nC. 5\nD. 6\nAnswer:"
    assert scorer.score(row, "Answer: B").correct
    assert scorer.score({**row, "answer": "b"}, "(B)").correct
    wrong = scorer.score(row, "Answer: A")
    assert (wrong.correct, wrong.answer) == (False, "A")
    assert scorer.score(row, "four").answer is None
    assert [f for f, _ in scorer.problems({"choices": ["a", "b"], "answer": "A"})] == ["question"]
    assert [f for f, _ in scorer.problems({"question": "q", "choices": ["a"], "answer": 0})] == [
        "choices"
    ]
    assert [
        f for f, _ in scorer.problems({"question": "q", "choices": ["a", "b"], "answer": 2})
    ] == ["answer"]


def test_loglik_picks_the_likeliest_choice_first_on_ties():
    # A deterministic "model": a choice is as likely as the share of its words found in the prompt.
    def logprob(prompt: str, continuation: str) -> float:
        words = continuation.split()
        return sum(0.0 if word in prompt else -5.0 for word in words)

    best, scores = choice.choose_by_loglik(
        "the cat sat on the mat", [" dog ran", " cat sat", " cat ran"], logprob
    )
    assert (best, scores) == (1, [-10.0, 0.0, -5.0])
    assert choice.choose_by_loglik("p", ["x", "y"], lambda p, c: -1.0)[0] == 0
    scorer = SCORERS["mmlu_loglik"]
    row = {"prompt": "the cat sat on the mat", "choices": ["dog", "cat sat"], "answer": "B"}
    assert scorer.score_choices(row, logprob).correct
    assert not scorer.score_choices({**row, "answer": "A"}, logprob).correct


def test_every_scorer_is_named_by_its_key():
    assert {name: scorer.name for name, scorer in SCORERS.items()} == {
        name: name for name in SCORERS
    }
    assert json.dumps(sorted(SCORERS)) == '["gsm8k", "ifeval", "mmlu", "mmlu_loglik"]'


def test_the_eval_config_offers_every_builtin_scorer():
    from rollout.config.evaluation import SCORER_NAMES

    assert set(SCORER_NAMES) == set(SCORERS)


def test_a_plugin_scorer_is_checked_on_every_call():
    from rollout.harness.eval.scorers import FunctionScorer, ScorerError

    def shouty(row, completion):
        return completion.isupper()

    scorer = FunctionScorer("./mine.py:shouty", shouty)
    assert scorer.problems({"prompt": "p"}) == [] and not scorer.votes
    assert scorer.score({"prompt": "p"}, "YES") == Score(1.0, True, None)
    assert scorer.score({"prompt": "p"}, "no") == Score(0.0, False, None)
    half = FunctionScorer("half", lambda row, completion: 0.5).score({"prompt": "p"}, "x")
    assert (half.value, half.correct) == (0.5, False)
    for bad in (1.5, -0.1, float("nan"), "1", None):
        with pytest.raises(ScorerError, match="not a score"):
            FunctionScorer("bad", lambda row, completion, bad=bad: bad).score({"prompt": "p"}, "x")
    with pytest.raises(ScorerError, match="raised KeyError"):
        FunctionScorer("key", lambda row, completion: row["missing"]).score({"prompt": "p"}, "x")
