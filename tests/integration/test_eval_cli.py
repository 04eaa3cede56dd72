"""`rollout eval` as a user runs it, on the tiny model: every suite's report and table, an eval
config with flags on top, log-likelihood choices checked against the model, and every bad input
-> exit 2 with one clear message."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.harness.eval.metrics import maj_at_k, pass_at_k
from rollout.harness.eval.scorers import SCORERS

runner = CliRunner()

GSM8K = [
    {
        "prompt": f"What is {i} + {i + 3}? End with #### and the number.",
        "answer": f"{i} + {i + 3} = {2 * i + 3}\n#### {2 * i + 3}",
        "category": "small" if i < 3 else "large",
    }
    for i in range(5)
]
IFEVAL = [
    {
        "prompt": "Write a few words.",
        "instruction_id_list": ["length_constraints:number_words", "punctuation:no_comma"],
        "kwargs": [{"relation": "less than", "num_words": 100}, {}],
    },
    {
        "prompt": "Reply in JSON, in capitals.",
        "instruction_id_list": ["detectable_format:json_format", "change_case:english_capital"],
        "kwargs": [{}, {}],
    },
]
MMLU = [
    {
        "question": "The sky is",
        "choices": ["blue", "green", "red"],
        "answer": "A",
        "category": "nature",
    },
    {"question": "2 + 2 =", "choices": ["3", "4", "5", "6"], "answer": 1, "category": "math"},
    {"question": "Water is", "choices": ["wet", "dry"], "answer": "A", "category": "nature"},
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("rollout-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ROLLOUT_CACHE", str(path))
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("COLUMNS", "200")
        yield path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def work(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    write_jsonl(tmp_path / "ifeval.jsonl", IFEVAL)
    write_jsonl(tmp_path / "mmlu.jsonl", MMLU)
    return tmp_path


def run_eval(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["eval", *args])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


TINY = ("--model", "tiny-llama", "--max-new-tokens", "8")


def check_report(report: dict, output: str) -> None:
    """Every number is in range, follows from the per-row results, and is in the table."""
    for suite in report["suites"]:
        scorer = SCORERS[suite["scorer"]]
        rows = suite["rows"]
        assert suite["n"] == len(rows) > 0
        for row in rows:
            assert len(row["scores"]) == len(row["correct"]) == suite["samples"]
            if "completions" in row:  # scored again from the text: the same scores
                data_row = _data_row(suite, row["index"])
                again = [scorer.score(data_row, text) for text in row["completions"]]
                assert [s.value for s in again] == row["scores"]
                assert [s.correct for s in again] == row["correct"]
        metrics = suite["metrics"]
        assert all(0.0 <= value <= 1.0 for value in metrics.values() if value is not None)
        mean = sum(sum(r["scores"]) / len(r["scores"]) for r in rows) / len(rows)
        assert metrics["score"] == pytest.approx(mean)
        for k in suite["k"]:
            expected = [pass_at_k(len(r["correct"]), sum(r["correct"]), k) for r in rows]
            assert metrics[f"pass@{k}"] == pytest.approx(sum(expected) / len(rows))
            if k > 1 and scorer.votes:
                voted = [maj_at_k(r["answers"], r["correct"], k) for r in rows]
                assert metrics[f"maj@{k}"] == pytest.approx(sum(voted) / len(rows))
        line = next(
            text
            for text in output.splitlines()
            if re.search(rf"│ {re.escape(suite['name'])}\s", text)
        )
        for value in metrics.values():
            assert (f"{value:.3f}" if value is not None else "-") in line
        for name, category in suite["categories"].items():
            members = [r for r in rows if r["category"] == name]
            assert category["n"] == len(members)


def _data_row(suite: dict, index: int) -> dict:
    lines = Path(suite["data"]).read_text().splitlines()
    return json.loads(lines[index])


@pytest.mark.parametrize(
    ("suite", "extra"),
    [
        ("gsm8k", ("--samples", "3", "--temperature", "0.8", "--k", "1", "--k", "2", "--k", "3")),
        ("ifeval", ("--samples", "2", "--temperature", "0.9")),
        ("mmlu", ()),
        ("mmlu_loglik", ()),
    ],
)
def test_each_suite_reports_consistent_scores(work, suite, extra):
    data = "mmlu.jsonl" if suite.startswith("mmlu") else f"{suite}.jsonl"
    args = ["--suite", suite, "--data", data, "--report", "out.json", *extra]
    args += ["--model", "tiny-llama"] if suite == "mmlu_loglik" else list(TINY)
    code, output = run_eval(*args)
    assert code == 0, output
    report = json.loads(Path("out.json").read_text())
    assert report["format"] == 1 and report["model"] == "tiny-llama"
    (only,) = report["suites"]
    assert (only["name"], only["scorer"]) == (suite, suite)
    expected_rows = {"gsm8k": GSM8K, "ifeval": IFEVAL}.get(suite, MMLU)
    assert only["n"] == len(expected_rows)
    samples = int(extra[extra.index("--samples") + 1]) if "--samples" in extra else 1
    assert only["samples"] == samples
    assert only["k"] == ([1, 2, 3] if suite == "gsm8k" else sorted({1, samples}))
    if suite == "ifeval":
        assert only["metrics"].get("maj@2", "absent") is None  # nothing to vote on
    if suite.startswith("mmlu"):
        assert set(only["categories"]) == {"nature", "math"}
        assert only["categories"]["nature"]["n"] == 2
    check_report(report, output)


def test_loglik_choices_are_the_models_likeliest(work):
    """The answers name the tiny model's own likeliest choice in two rows of four and another
    choice in the rest, found here by a separate forward per choice: the score must be 0.5."""
    from rollout.config.model import ModelSection
    from rollout.models.loading import load_model
    from rollout.planner.inspect_model import inspect_model

    section = ModelSection(builtin="tiny-llama")
    loaded = load_model(
        inspect_model(section, base_dir=work), section, dtype="float32", device="cpu"
    )
    questions = ["The sky is", "Two and two make", "Fire is", "The sea is"]
    choices = ["blue and wide", "four", "hot", "green"]
    rows = []
    for number, question in enumerate(questions):
        prompt = SCORERS["mmlu_loglik"].prompt({"question": question, "choices": choices})
        ids = loaded.tokenizer.encode(prompt, add_special_tokens=True)
        sums = []
        for choice in choices:
            tokens = loaded.tokenizer.encode(f" {choice}", add_special_tokens=False)
            with torch.no_grad():
                logits = loaded.model(input_ids=torch.tensor([ids + tokens])).logits[0]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            sums.append(sum(float(logprobs[len(ids) - 1 + i, t]) for i, t in enumerate(tokens)))
        best = max(range(len(choices)), key=lambda i: sums[i])
        answer = best if number < 2 else (best + 1) % len(choices)
        rows.append({"question": question, "choices": choices, "answer": answer})
    write_jsonl(work / "picked.jsonl", rows)
    code, output = run_eval(
        "--model",
        "tiny-llama",
        "--no-chat-template",
        "--suite",
        "mmlu_loglik",
        "--data",
        "picked.jsonl",
        "--report",
        "out.json",
    )
    assert code == 0, output
    report = json.loads(Path("out.json").read_text())
    assert report["suites"][0]["metrics"]["score"] == 0.5
    assert [r["correct"] for r in report["suites"][0]["rows"]] == [[True], [True], [False], [False]]


EVAL_TOML = """
[model]
builtin = "tiny-llama"

[generation]
max_new_tokens = 6

[[suites]]
name = "math"
scorer = "gsm8k"
data = "data/gsm8k.jsonl"
samples = 4
k = [1, 4]
temperature = 0.9

[[suites]]
name = "instructions"
scorer = "ifeval"
data = "data/ifeval.jsonl"

[[suites]]
name = "choices"
scorer = "mmlu_loglik"
data = "data/mmlu.jsonl"
"""


@pytest.fixture
def config(work: Path) -> Path:
    (work / "data").mkdir()
    for name in ("gsm8k", "ifeval", "mmlu"):
        (work / "data" / f"{name}.jsonl").write_text((work / f"{name}.jsonl").read_text())
    path = work / "eval.toml"
    path.write_text(EVAL_TOML)
    return path


def test_config_runs_every_suite_and_flags_override_it(config):
    code, output = run_eval("--config", "eval.toml", "--report", "all.json")
    assert code == 0, output
    report = json.loads(Path("all.json").read_text())
    assert [s["name"] for s in report["suites"]] == ["math", "instructions", "choices"]
    math = report["suites"][0]
    assert (math["samples"], math["k"], math["settings"]["max_new_tokens"]) == (4, [1, 4], 6)
    assert report["suites"][1]["settings"]["temperature"] == 0.0  # one sample: greedy
    check_report(report, output)
    # Flags win over the config; --suite picks suites.
    code, output = run_eval(
        "--config",
        "eval.toml",
        "--suite",
        "math",
        "--samples",
        "2",
        "--k",
        "2",
        "--limit",
        "2",
        "--report",
        "one.json",
    )
    assert code == 0, output
    (math,) = json.loads(Path("one.json").read_text())["suites"]
    assert (math["n"], math["samples"], math["k"]) == (2, 2, [2])
    assert all(len(row["completions"]) == 2 for row in math["rows"])
    # A flag that breaks a suite's own setting is named with it (math asks for k = 4).
    expect_refusal(
        "--config", "eval.toml", "--samples", "2", said=["suites[0].k", "k <= samples (2)"]
    )
    # Sampling flags change the suites that sample; the log-likelihood suite keeps its one.
    code, output = run_eval(
        "--config",
        "eval.toml",
        "--samples",
        "2",
        "--k",
        "2",
        "--max-new-tokens",
        "4",
        "--limit",
        "2",
        "--report",
        "flags.json",
    )
    assert code == 0, output
    suites = json.loads(Path("flags.json").read_text())["suites"]
    assert [(s["samples"], s["n"], s["k"]) for s in suites] == [
        (2, 2, [2]),
        (2, 2, [2]),
        (1, 2, [1]),
    ]
    assert (
        suites[0]["settings"]["max_new_tokens"] == 4
        and "max_new_tokens" not in suites[2]["settings"]
    )
    expect_refusal(
        "--config",
        "eval.toml",
        "--suite",
        "choices",
        "--samples",
        "2",
        said=["--samples", "means nothing here"],
    )


def test_the_same_command_gives_the_same_report(config):
    for name in ("a.json", "b.json"):
        code, output = run_eval("--config", "eval.toml", "--suite", "math", "--report", name)
        assert code == 0, output
    first, second = (json.loads(Path(name).read_text()) for name in ("a.json", "b.json"))
    assert first["suites"] == second["suites"]


def expect_refusal(*args: str, said: list[str]) -> str:
    code, output = run_eval(*args)
    assert code == 2, output
    flat = " ".join(output.split())
    for words in said:
        assert words in flat, output
    return output


def test_bad_input_is_one_clear_error(work):
    expect_refusal(
        *TINY, "--suite", "gsm8k", "--data", "missing.jsonl", said=["--data", "missing.jsonl"]
    )
    expect_refusal(
        *TINY, "--suite", "gsm8", "--data", "gsm8k.jsonl", said=["--suite", "did you mean 'gsm8k'"]
    )
    expect_refusal(*TINY, "--data", "gsm8k.jsonl", said=["--suite", "name one suite"])
    expect_refusal(*TINY, "--suite", "gsm8k", said=["--data"])
    expect_refusal(
        *TINY,
        "--suite",
        "gsm8k",
        "--data",
        "gsm8k.jsonl",
        "--samples",
        "2",
        "--k",
        "4",
        "--temperature",
        "1",
        said=["--k", "k <= samples (2)"],
    )
    expect_refusal(
        *TINY,
        "--suite",
        "gsm8k",
        "--data",
        "gsm8k.jsonl",
        "--samples",
        "3",
        "--temperature",
        "0",
        said=["--temperature", "all the same completion"],
    )
    expect_refusal(
        "--model",
        "tiny-llama",
        "--suite",
        "mmlu_loglik",
        "--data",
        "mmlu.jsonl",
        "--samples",
        "2",
        said=["--samples", "samples must be 1"],
    )
    expect_refusal(
        "--model",
        "tiny-llama",
        "--suite",
        "mmlu_loglik",
        "--data",
        "mmlu.jsonl",
        "--seed",
        "3",
        said=["--seed", "nothing is sampled"],
    )
    rows = [GSM8K[0], {"prompt": "no answer here"}, {"question": "no prompt", "answer": 3}]
    write_jsonl(work / "bad.jsonl", rows)
    output = expect_refusal(
        *TINY,
        "--suite",
        "gsm8k",
        "--data",
        "bad.jsonl",
        said=["record 2 (line 2)", "field 'answer' missing", "record 3 (line 3)", "field 'prompt'"],
    )
    assert "record 1 " not in output
    write_jsonl(
        work / "bad_ifeval.jsonl",
        [{**IFEVAL[0], "instruction_id_list": ["no:such", "punctuation:no_comma"]}],
    )
    expect_refusal(
        *TINY,
        "--suite",
        "ifeval",
        "--data",
        "bad_ifeval.jsonl",
        said=["record 1 (line 1)", "instruction 0 (no:such) is not one rollout checks"],
    )
    chat = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": 4}]
    write_jsonl(work / "chat.jsonl", chat)
    expect_refusal(
        *TINY,
        "--no-chat-template",
        "--suite",
        "gsm8k",
        "--data",
        "chat.jsonl",
        said=["record 1 (line 1)", "holds chat messages"],
    )
    code, output = run_eval(*TINY, "--suite", "gsm8k", "--data", "chat.jsonl")
    assert code == 0, output  # with the chat template, messages are a prompt like any other
    (work / "notjson.jsonl").write_text('{"prompt": "x", "answer": 1}\n{broken\n')
    expect_refusal(
        *TINY, "--suite", "gsm8k", "--data", "notjson.jsonl", said=["line 2", "not valid JSON"]
    )
    (work / "out_dir").mkdir()
    expect_refusal(
        *TINY,
        "--suite",
        "gsm8k",
        "--data",
        "gsm8k.jsonl",
        "--report",
        "out_dir",
        said=["--report", "is a directory"],
    )
    expect_refusal("--suite", "gsm8k", "--data", "gsm8k.jsonl", said=["--model", "no model"])


def test_bad_config_is_one_clear_error(config):
    config.write_text(
        EVAL_TOML
        + '\n[[suites]]\nname = "x"\nscorer = "gsm8k"\ndata = "d.jsonl"\nsamples = 2\nk = [3]\ntemperature = 1.0\ncolour = "red"\n'
    )
    expect_refusal("--config", "eval.toml", said=["suites[3].colour"])
    config.write_text(EVAL_TOML.replace("k = [1, 4]", "k = [1, 8]"))
    expect_refusal("--config", "eval.toml", said=["suites[0].k", "k <= samples (4)"])
    config.write_text(EVAL_TOML.replace('scorer = "ifeval"', 'scorer = "ifevl"'))
    expect_refusal("--config", "eval.toml", said=["suites[1].scorer"])
    config.write_text(EVAL_TOML)
    expect_refusal(
        "--config", "eval.toml", "--data", "x.jsonl", said=["--data", "3 suites are chosen"]
    )
    expect_refusal(
        "--config", "eval.toml", "--suite", "maths", said=["--suite", "did you mean 'math'"]
    )
    config.write_text(EVAL_TOML.replace("data/ifeval.jsonl", "data/nothing.jsonl"))
    expect_refusal("--config", "eval.toml", said=["suites[1].data", "nothing.jsonl"])


RUN = "grpo-tiny-20260101-000000-abc123"


@pytest.fixture
def run_checkpoints(work: Path):
    """A run in a SQLite store with two checkpoints of the tiny model (different weights)."""
    from rollout.config.model import ModelSection
    from rollout.models.loading import load_model
    from rollout.planner.inspect_model import inspect_model
    from rollout.runtime.checkpoint import save_checkpoint
    from rollout.storage import open_store
    from rollout.storage.base import CheckpointRecord

    section = ModelSection(builtin="tiny-llama")
    loaded = load_model(
        inspect_model(section, base_dir=work), section, dtype="float32", device="cpu"
    )
    root = work / "checkpoints"
    location = f"sqlite:{work / 'rollout.db'}"
    with open_store(location) as store:
        store.create_run(
            RUN, name="grpo-tiny", plan_sha256="x", plan_path=str(work / "gone.lock"), run_dir=""
        )
        for step in (10, 20):
            torch.manual_seed(step)
            with torch.no_grad():
                for parameter in loaded.model.parameters():
                    parameter.add_(0.05 * torch.randn_like(parameter))
            path = save_checkpoint(
                root,
                step,
                model=loaded.model,
                tokenizer=loaded.tokenizer,
                optimizer=None,
                scheduler=None,
                trainer_state={},
                keep_last=5,
                run_id=RUN,
            )
            store.add_checkpoint(CheckpointRecord(RUN, step, str(path), time.time()))
    return root, location


def test_run_records_scores_at_each_checkpoints_step(run_checkpoints):
    from rollout.storage import open_store

    root, location = run_checkpoints
    reports = {}
    for step in (10, 20):
        code, output = run_eval(
            "--checkpoint",
            str(root / f"step-{step:06d}"),
            "--run",
            RUN,
            "--store",
            location,
            "--suite",
            "mmlu_loglik",
            "--data",
            "mmlu.jsonl",
            "--report",
            f"{step}.json",
        )
        assert code == 0, output
        assert f"at step {step}" in output
        reports[step] = json.loads(Path(f"{step}.json").read_text())["suites"][0]
    with open_store(location, create=False) as store:
        rows = store.metrics(RUN)
    recorded = {(row.name, row.step): row.value for row in rows}
    for step, suite in reports.items():
        assert recorded[("eval/mmlu_loglik/score", step)] == suite["metrics"]["score"]
        assert recorded[("eval/mmlu_loglik/pass@1", step)] == suite["metrics"]["pass@1"]
        nature = suite["categories"]["nature"]["metrics"]["score"]
        assert recorded[("eval/mmlu_loglik/nature/score", step)] == nature
    assert {step for _, step in recorded} == {10, 20}
    # Listed (and drawn) over the run's steps.
    listed = runner.invoke(app, ["runs", "metrics", RUN, "--name", "eval/", "--store", location])
    assert listed.exit_code == 0, listed.output
    assert re.search(r"eval/mmlu_loglik/score\s.*10\.\.20", listed.output), listed.output
    as_json = runner.invoke(
        app,
        [
            "runs",
            "metrics",
            RUN,
            "--name",
            "eval/mmlu_loglik/s",
            "--store",
            location,
            "--format",
            "json",
        ],
    )
    series = json.loads(as_json.output)["metrics"]
    assert list(series) == ["eval/mmlu_loglik/score"]
    assert series["eval/mmlu_loglik/score"] == [
        [step, reports[step]["metrics"]["score"]] for step in (10, 20)
    ]


def test_run_needs_a_checkpoint_of_a_known_run(run_checkpoints):
    root, location = run_checkpoints
    suite = ("--suite", "mmlu_loglik", "--data", "mmlu.jsonl", "--store", location)
    expect_refusal("--model", "tiny-llama", "--run", RUN, *suite, said=["--run", "no --checkpoint"])
    expect_refusal("--model", "tiny-llama", *suite, said=["--store", "neither is given"])
    expect_refusal(
        "--checkpoint",
        str(root / "step-000010"),
        "--run",
        RUN[:-1] + "x",
        *suite,
        said=["did you mean"],
    )


def test_every_example_eval_config_validates_and_the_tiny_ones_run(work):
    from rollout.config.evaluation import EvalConfig
    from rollout.config.load import read_config_file
    from tests.conftest import EVAL_SUFFIX, EXAMPLES

    examples = sorted(EXAMPLES.glob(f"*{EVAL_SUFFIX}"))
    assert len(examples) >= 2
    for path in examples:
        config = EvalConfig.model_validate(read_config_file(path))
        for suite in config.suites:
            assert (path.parent / suite.data).is_file(), (path, suite.data)
    tiny = [path for path in examples if path.name.startswith("tiny")]
    assert tiny
    for path in tiny:
        code, output = run_eval("--config", str(path), "--limit", "3", "--report", "example.json")
        assert code == 0, (path, output)
        report = json.loads(Path("example.json").read_text())
        assert all(suite["n"] == 3 for suite in report["suites"])
        check_report(report, output)


PLUGIN = '''
def mentions_a_digit(row, completion):
    """1 when the completion writes any digit."""
    return any(character.isdigit() for character in completion)


def broken(row, completion):
    return row["no_such_field"]
'''


def test_a_plugin_scorer_from_a_file(config):
    (config.parent / "scorers.py").write_text(PLUGIN)
    config.write_text(
        EVAL_TOML
        + '\n[[suites]]\nname = "digits"\nscorer = "./scorers.py:mentions_a_digit"\n'
        + 'data = "data/gsm8k.jsonl"\nsamples = 2\ntemperature = 1.0\n'
    )
    code, output = run_eval("--config", "eval.toml", "--suite", "digits", "--report", "p.json")
    assert code == 0, output
    (suite,) = json.loads(Path("p.json").read_text())["suites"]
    assert suite["scorer"] == "./scorers.py:mentions_a_digit"
    plugin = suite["scorer_plugin"]
    assert (plugin["kind"], plugin["used_by"]) == ("file", "suites[3].scorer")
    assert plugin["sha256"]
    for row in suite["rows"]:
        expected = [float(any(c.isdigit() for c in text)) for text in row["completions"]]
        assert row["scores"] == expected
    assert "maj@2" not in suite["metrics"] or suite["metrics"]["maj@2"] is None
    # A scorer that raises names itself and the row; one that is not there, the config key.
    config.write_text(config.read_text().replace(":mentions_a_digit", ":broken"))
    expect_refusal(
        "--config",
        "eval.toml",
        "--suite",
        "digits",
        said=["./scorers.py:broken raised KeyError", "record 1 (line 1)"],
    )
    config.write_text(config.read_text().replace("./scorers.py:broken", "./missing.py:score"))
    expect_refusal("--config", "eval.toml", "--suite", "digits", said=["suites[3].scorer"])
