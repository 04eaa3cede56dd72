"""`rollout plan` catches the data mistakes of offline runs before step 1: the fields an algorithm
needs, an empty split, pairs that prefer nothing, records longer than max_length, KTO labels that
are not booleans; each names the file, the record and the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.errors import PlanError
from rollout.planner.builder import build_plan
from tests.unit.conftest import (
    ALGORITHMS,
    DEMOS,
    JUDGED,
    PAIRS,
    RECORDS,
    offline_config,
    write_jsonl,
)


def plan_issues(path: Path) -> list:
    with pytest.raises(PlanError) as raised:
        build_plan(path)
    return raised.value.issues


@pytest.mark.parametrize("kind", sorted(ALGORITHMS))
def test_every_offline_kind_plans_its_example_data(tmp_path, kind):
    plan = build_plan(offline_config(tmp_path, kind, eval_records=RECORDS[kind]))
    assert plan.derived.total_steps == 2
    assert {f.split: f.num_records for f in plan.data} == {"train": 8, "eval": 8}


@pytest.mark.parametrize(
    ("kind", "missing"), [("dpo", "rejected"), ("kto", "label"), ("sft", "completion")]
)
def test_a_record_without_a_needed_field(tmp_path, kind, missing):
    records = [dict(r) for r in RECORDS[kind]]
    del records[2][missing]
    (issue,) = plan_issues(offline_config(tmp_path, kind, records))
    assert issue.path == f"data.fields.{missing}"
    assert issue.message.startswith(f"record 3 (line 3) of {tmp_path / 'train.jsonl'}")
    assert f"has no field {missing!r}" in issue.message


def test_an_empty_eval_split(tmp_path):
    (issue,) = plan_issues(offline_config(tmp_path, "dpo", eval_records=[]))
    assert issue.path == "data.eval.path"
    assert issue.message == f"{tmp_path / 'eval.jsonl'} holds no records"


def test_a_pair_whose_chosen_and_rejected_are_identical(tmp_path):
    records = [dict(r) for r in PAIRS]
    records[4]["rejected"] = records[4]["chosen"]
    (issue,) = plan_issues(offline_config(tmp_path, "rm", records))
    assert issue.message.startswith(
        f"record 5 (line 5) of {tmp_path / 'train.jsonl'}: 'chosen' and 'rejected' are identical"
    )


@pytest.mark.parametrize(
    ("kind", "field", "what"),
    [
        ("dpo", "rejected", "'prompt' + 'rejected'"),
        ("kto", "completion", "'prompt' + 'completion'"),
        ("sft", "completion", "'prompt' + 'completion'"),
    ],
)
def test_a_record_longer_than_max_length(tmp_path, kind, field, what):
    records = [dict(r) for r in RECORDS[kind]]
    records[6][field] = "forty two " * 30
    (issue,) = plan_issues(offline_config(tmp_path, kind, records, max_length=64))
    assert issue.path == "algorithm.max_length"
    assert issue.message.startswith(f"record 7 (line 7) of {tmp_path / 'train.jsonl'}: {what} is ")
    assert "tokens, longer than max_length 64" in issue.message
    assert "raise algorithm.max_length to at least" in issue.hint


def test_records_longer_than_max_length_make_one_issue_at_the_longest(tmp_path):
    records = [dict(r) for r in DEMOS]
    records[1]["completion"] = "forty two " * 30
    records[5]["completion"] = "forty two " * 40
    (issue,) = plan_issues(offline_config(tmp_path, "sft", records, max_length=64))
    assert issue.message.startswith(f"record 6 (line 6) of {tmp_path / 'train.jsonl'}: ")
    assert issue.message.endswith(
        "(the longest of 2 records over the limit; the first is record 2 (line 2))"
    )
    length = int(issue.message.split(" is ")[1].split(" tokens")[0])
    assert issue.hint.startswith(f"raise algorithm.max_length to at least {length},")


def test_sft_messages_longer_than_max_length_name_the_messages_field(tmp_path):
    conversation = [
        {"role": "user", "content": "Count."},
        {"role": "assistant", "content": "one two three four " * 20},
    ]
    write_jsonl(tmp_path / "chats.jsonl", [{"chat": conversation}])
    path = offline_config(tmp_path, "sft")
    text = path.read_text().replace('"train.jsonl"', '"chats.jsonl"')
    text = text.replace('prompt = "prompt"\ncompletion = "completion"', 'messages = "chat"')
    path.write_text(text)
    (issue,) = plan_issues(path)
    assert issue.path == "algorithm.max_length" and "'chat' is " in issue.message


def test_a_kto_label_that_is_not_a_boolean(tmp_path):
    records = [dict(r) for r in JUDGED]
    records[1]["label"] = "yes"
    (issue,) = plan_issues(offline_config(tmp_path, "kto", records))
    assert issue.path == "data.fields.label"
    assert issue.message.startswith(f"record 2 (line 2) of {tmp_path / 'train.jsonl'}")
    assert "'label' is 'yes', not a boolean" in issue.message


def test_the_cli_reports_them_all_with_exit_code_2_and_no_traceback(tmp_path):
    records = [dict(r) for r in PAIRS]
    records[0]["chosen"] = "many words " * 40
    records[3]["rejected"] = records[3]["chosen"]
    path = offline_config(tmp_path, "dpo", records, eval_records=[])
    result = CliRunner().invoke(app, ["plan", "--config", str(path), "-o", str(tmp_path / "p")])
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert "3 problems" in output
    assert "record 1 (line 1)" in output and "longer than max_length 64" in output
    assert "record 4 (line 4)" in output and "identical" in output
    assert "holds no records" in output
    assert "Traceback" not in result.output
