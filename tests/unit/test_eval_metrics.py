"""pass@k and maj@k against values computed by hand, and their aggregation."""

from __future__ import annotations

from math import comb

import pytest

from rollout.harness.eval.metrics import RowResult, by_category, maj_at_k, pass_at_k, summarize


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (4, 0, 2, 0.0),  # nothing correct: never
        (4, 1, 1, 0.25),  # pass@1 is the share correct
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 5, 1 - 21 / 252),  # C(7,5)=21, C(10,5)=252
        (4, 3, 2, 1.0),  # n - c = 1 < k: every pair holds a correct one
        (4, 4, 4, 1.0),
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_the_binomial_form_for_large_n():
    for n, c, k in [(200, 13, 10), (200, 0, 100), (200, 199, 1), (100, 50, 50)]:
        exact = 1 - comb(n - c, k) / comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 4, 1), (3, -1, 1), (3, 1, 4), (3, 1, 0)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_maj_at_k():
    # "72" twice beats "70" once: right.
    assert maj_at_k(["72", "70", "72"], [True, False, True], 3) == 1.0
    # The majority is wrong even though one sample is right.
    assert maj_at_k(["70", "72", "70"], [False, True, False], 3) == 0.0
    # Only the first k vote.
    assert maj_at_k(["70", "72", "72", "72"], [False, True, True, True], 1) == 0.0
    # A tie goes to the answer given first; samples without an answer do not vote.
    assert maj_at_k(["72", "70"], [True, False], 2) == 1.0
    assert maj_at_k(["70", "72"], [False, True], 2) == 0.0
    assert maj_at_k([None, None, "72"], [False, False, True], 3) == 1.0
    assert maj_at_k([None, None], [False, False], 2) == 0.0
    with pytest.raises(ValueError):
        maj_at_k(["1"], [True], 2)


def test_summarize_and_categories():
    rows = [
        RowResult("algebra", [1.0, 0.0], [True, False], ["4", "5"]),
        RowResult("algebra", [0.0, 0.0], [False, False], ["1", None]),
        RowResult("geometry", [1.0, 1.0], [True, True], ["9", "9"]),
    ]
    summary = summarize(rows, [1, 2])
    assert summary["score"] == pytest.approx(0.5)
    assert summary["pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert summary["pass@2"] == pytest.approx((1 + 0 + 1) / 3)
    assert summary["maj@2"] == pytest.approx((1 + 0 + 1) / 3)  # a tie: the first answer, right
    assert "maj@1" not in summary
    categories = by_category(rows, [1, 2])
    assert list(categories) == ["algebra", "geometry"]
    assert categories["algebra"][0] == 2
    assert categories["algebra"][1]["pass@2"] == pytest.approx(0.5)
    assert categories["geometry"][1]["score"] == 1.0
    # No answers to vote on (IFEval): maj@k is not a number, not a zero.
    unvoted = [RowResult(None, [0.5, 1.0], [False, True], None)]
    assert summarize(unvoted, [2])["maj@2"] is None
    assert by_category(unvoted, [2]) == {}


def test_an_eval_config_refuses_generation_keys_it_would_not_read(tmp_path):
    from rollout import ConfigError
    from rollout.inference.eval_suites import read_eval_config

    path = tmp_path / "e.eval.toml"
    suite = '[[suites]]\nname = "g"\nscorer = "gsm8k"\ndata = "x.jsonl"\n'
    path.write_text("[generation]\nmax_prompt_tokens = 10\ngpu_memory_utilization = 0.5\n" + suite)
    with pytest.raises(ConfigError) as caught:
        read_eval_config(path)
    assert [i.path for i in caught.value.issues] == [
        "generation.max_prompt_tokens",
        "generation.gpu_memory_utilization",
    ]
    path.write_text('[generation]\nengine = "vllm"\ngpu_memory_utilization = 0.5\n' + suite)
    assert read_eval_config(path).generation.gpu_memory_utilization == 0.5
