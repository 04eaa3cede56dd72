"""inspect_data on JSONL and Parquet files, local and over fsspec, and the Issue each kind of bad
data produces."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from rollout.config.data import DataSource
from rollout.errors import PlanError
from rollout.planner.inspect_data import MAX_ISSUES_PER_FILE, inspect_data

QA = {"prompt": "question", "answer": "answer"}
PAIRS = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def inspect(path: str, base_dir: Path, *, split="train", required=QA, paired=None, **source):
    return inspect_data(
        DataSource(path=path, **source),
        split=split,
        base_dir=base_dir,
        required=required,
        paired=paired,
    )


def issues_of(path: str, base_dir: Path, **kwargs) -> list:
    with pytest.raises(PlanError) as raised:
        inspect(path, base_dir, **kwargs)
    return raised.value.issues


def only_issue(path: str, base_dir: Path, **kwargs):
    issues = issues_of(path, base_dir, **kwargs)
    assert len(issues) == 1, issues
    return issues[0]


def qa(n: int) -> list[dict]:
    return [{"question": f"{i}+1?", "answer": str(i + 1)} for i in range(n)]


# --- JSONL ---------------------------------------------------------------------------------------


def test_jsonl(tmp_path):
    path = tmp_path / "train.jsonl"
    lines = [
        '{"question": "1+1?", "answer": "2"}',
        "",
        "  ",
        '{"question": "2+2?", "answer": "4", "id": 7}',
    ]
    path.write_text("\n".join(lines) + "\n")
    facts = inspect("train.jsonl", tmp_path)
    assert (facts.split, facts.location, facts.format) == ("train", str(path), "jsonl")
    assert facts.num_records == 2  # blank lines are skipped
    assert facts.fields == ["answer", "id", "question"]
    assert facts.size_bytes == path.stat().st_size
    assert facts.fingerprint == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", ["data.json", "data.NDJSON", "data.txt"])
def test_jsonl_extensions_and_explicit_format(tmp_path, name):
    write_jsonl(tmp_path / name, qa(3))
    source = {"format": "jsonl"} if name.endswith(".txt") else {}
    assert inspect(name, tmp_path, **source).num_records == 3


def test_limit_caps_the_records_considered(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", qa(5))
    with path.open("a") as handle:
        handle.write("not json\n")  # beyond the limit: never read
    facts = inspect("train.jsonl", tmp_path, limit=3)
    assert facts.num_records == 3
    assert facts.fingerprint == hashlib.sha256(path.read_bytes()).hexdigest()


def test_missing_field_names_file_record_line_and_near_field(tmp_path):
    records = qa(2) + [{"questoin": "x", "answer": "1"}] * 3
    path = tmp_path / "train.jsonl"
    path.write_text("\n" + "".join(json.dumps(record) + "\n" for record in records))
    issue = only_issue("train.jsonl", tmp_path)
    assert issue.path == "data.fields.prompt"
    assert issue.message == (
        f"record 3 (line 4) of {path} has no field 'question' (nor do 2 other records); "
        "records have: answer, question, questoin"
    )
    assert issue.value == "question"
    assert issue.hint == (
        "did you mean 'questoin'? set data.fields.prompt to the field that holds the prompt"
    )


def test_null_field(tmp_path):
    path = write_jsonl(tmp_path / "eval.jsonl", [*qa(1), {"question": "q", "answer": None}])
    issue = only_issue("eval.jsonl", tmp_path, split="eval")
    assert issue.path == "data.fields.answer"
    assert issue.message == f"record 2 (line 2) of {path} has 'answer' = null"


def test_bad_json_and_non_object_lines(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "q", "answer": "a"}\n{"question": "q",\n[1, 2]\n')
    bad, array = issues_of("train.jsonl", tmp_path)
    assert bad.path == array.path == "data.train.path"
    assert bad.message.startswith(f"line 2 of {path} is not valid JSON: Expecting property name")
    assert array.message == f"line 3 of {path} holds an array, not a JSON object"
    assert "one JSON object per line" in array.hint


def test_chosen_equal_to_rejected(tmp_path):
    records = [
        {"prompt": "p", "chosen": "good", "rejected": "bad"},
        {"prompt": "p", "chosen": "same", "rejected": "same"},
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    issue = only_issue("pairs.jsonl", tmp_path, required=PAIRS, paired=("chosen", "rejected"))
    assert issue.path == "data.train.path"
    assert issue.message.startswith(
        f"record 2 (line 2) of {path}: 'chosen' and 'rejected' are identical"
    )


def test_at_most_ten_record_problems_then_a_count(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("oops\n" * (MAX_ISSUES_PER_FILE + 5))
    issues = issues_of("train.jsonl", tmp_path)
    assert len(issues) == MAX_ISSUES_PER_FILE + 1
    assert issues[-1].message == f"... and 5 more problems in {path}"


def test_empty_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n\n")
    issue = only_issue("train.jsonl", tmp_path)
    assert issue.path == "data.train.path"
    assert issue.message == f"{path} holds no records"


def test_unknown_extension(tmp_path):
    write_jsonl(tmp_path / "train.csv", qa(1))
    issue = only_issue("train.csv", tmp_path)
    assert issue.path == "data.train.format"
    assert issue.message.startswith(f"cannot tell the format of {tmp_path / 'train.csv'}")
    assert issue.hint == "set data.train.format = 'jsonl' or 'parquet'"


def test_missing_file_suggests_a_near_name(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", qa(1))
    issue = only_issue("trian.jsonl", tmp_path)
    assert issue.path == "data.train.path"
    assert issue.message == f"train data file not found: {tmp_path / 'trian.jsonl'}"
    assert issue.hint == "did you mean 'train.jsonl'?"


def test_missing_file_says_relative_paths_start_at_the_config_files_directory(tmp_path):
    issue = only_issue("nothing-like-it.jsonl", tmp_path)
    assert issue.hint == "relative paths start at the config file's directory"


def test_jsonl_over_fsspec(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    data = write_jsonl(tmp_path / "t.jsonl", qa(4)).read_bytes()
    fsspec.filesystem("memory").pipe("/data-test/train.jsonl", data)
    facts = inspect("memory://data-test/train.jsonl", tmp_path)
    assert (facts.location, facts.num_records) == ("memory://data-test/train.jsonl", 4)
    assert facts.size_bytes == len(data)


# --- Parquet -------------------------------------------------------------------------------------


def test_parquet(tmp_path):
    rows = [{**row, "id": i} for i, row in enumerate(qa(6))]
    path = write_parquet(tmp_path / "train.parquet", rows)
    facts = inspect("train.parquet", tmp_path)
    assert (facts.format, facts.num_records) == ("parquet", 6)
    assert facts.fields == ["answer", "id", "question"]
    assert facts.fingerprint == hashlib.sha256(path.read_bytes()).hexdigest()
    assert inspect("train.parquet", tmp_path, limit=4).num_records == 4


def test_parquet_missing_column(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", [{"question": "q", "answr": "a"}])
    issue = only_issue("train.parquet", tmp_path)
    assert issue.path == "data.fields.answer"
    assert issue.message == f"{path} has no column 'answer'; its columns: question, answr"
    assert issue.hint.startswith("did you mean 'answr'?")


def test_parquet_nulls_and_pairs(tmp_path):
    rows = [
        {"prompt": "p", "chosen": "a", "rejected": "b"},
        {"prompt": None, "chosen": "a", "rejected": "b"},
        {"prompt": "p", "chosen": "c", "rejected": "c"},
    ]
    path = write_parquet(tmp_path / "pairs.parquet", rows)
    null, same = issues_of("pairs.parquet", tmp_path, required=PAIRS, paired=("chosen", "rejected"))
    assert (null.path, same.path) == ("data.fields.prompt", "data.train.path")
    assert null.message == f"record 2 of {path} has 'prompt' = null"
    assert same.message.startswith(f"record 3 of {path}: 'chosen' and 'rejected' are identical")
    # The limit stops before the bad rows.
    assert inspect("pairs.parquet", tmp_path, required=PAIRS, limit=1).num_records == 1


def test_parquet_format_on_a_file_that_is_not(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", qa(1))
    issue = only_issue("train.jsonl", tmp_path, format="parquet")
    assert issue.path == "data.train.path"
    assert issue.message.startswith(f"cannot read {path} as parquet:")


def test_parquet_over_fsspec(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    data = write_parquet(tmp_path / "t.parquet", qa(3)).read_bytes()
    fsspec.filesystem("memory").pipe("/data-test/train.parquet", data)
    facts = inspect("memory://data-test/train.parquet", tmp_path)
    assert (facts.format, facts.num_records, facts.size_bytes) == ("parquet", 3, len(data))
