"""[[eval.suites]] in a run config: `rollout run` scores the suites on the policy at step 0,
every run.eval_interval steps and at the last step (two ranks, each scoring a shard), and the
scores at the last step equal what `rollout eval --checkpoint` reports for the final checkpoint
(greedy, one sample: the same completions). A changed suite file makes the plan stale; a bad
suite is refused at plan, naming the field and the row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rollout.storage import open_store
from tests.integration.driver import plan_with, rollout

pytestmark = pytest.mark.slow

GSM8K = [
    {
        "prompt": f"What is {i} + {i + 3}? End with #### and the number.",
        "answer": f"{i} + {i + 3} = {2 * i + 3}\n#### {2 * i + 3}",
        "category": "small" if i < 3 else "large",
    }
    for i in range(5)
]
MMLU = [
    {"question": "The sky is", "choices": ["blue", "green", "red"], "answer": "A"},
    {"question": "2 + 2 =", "choices": ["3", "4", "5", "6"], "answer": 1},
    {"question": "Water is", "choices": ["wet", "dry"], "answer": "A"},
]
# A random tiny model answers no sum right: this scorer tells completions apart, so the
# comparison with `rollout eval` is of the completions themselves, not of zeros.
DIGEST = """
def digest(row, completion):
    return sum(map(ord, completion)) % 97 / 96
"""
SUITES = [
    {"name": "sums", "scorer": "gsm8k", "data": "gsm8k.jsonl", "max_new_tokens": 12},
    {"name": "digest", "scorer": "./digest.py:digest", "data": "gsm8k.jsonl", "max_new_tokens": 12},
    {"name": "choices", "scorer": "mmlu_loglik", "data": "mmlu.jsonl"},
]
STEPS = 3


def _toml_suites(suites: list[dict]) -> str:
    def value(v: object) -> str:
        return json.dumps(v)

    tables = ", ".join(
        "{ " + ", ".join(f"{k} = {value(v)}" for k, v in suite.items()) + " }" for suite in suites
    )
    return f"eval.suites=[{tables}]"


@pytest.fixture
def suites_dir(workdir: Path) -> Path:
    examples = workdir / "examples"
    (examples / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    (examples / "mmlu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MMLU))
    (examples / "digest.py").write_text(DIGEST)
    return examples


def _settings(*extra: str) -> list[str]:
    settings = [
        "data.eval=null",
        f"algorithm.max_steps={STEPS}",
        "run.eval_interval=2",
        "cluster.threads_per_process=1",
        _toml_suites(SUITES),
        *extra,
    ]
    return [arg for setting in settings for arg in ("--set", setting)]


def test_suites_are_scored_during_training_as_rollout_eval_scores_them(
    workdir: Path, suites_dir: Path
) -> None:
    result = rollout(
        workdir,
        "run",
        "--config",
        "examples/grpo-tiny.toml",
        *_settings("cluster.nproc_per_node=2"),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    store = open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False)
    (run,) = store.list_runs()
    recorded = [m for m in store.metrics(run.run_id, None) if m.name.startswith("eval/")]
    steps: dict[str, list[int]] = {}
    for metric in recorded:
        steps.setdefault(metric.name, []).append(metric.step)
    for name in ("eval/sums/score", "eval/sums/small/pass@1", "eval/digest/score"):
        assert sorted(steps[name]) == [0, 2, STEPS], name
    assert sorted(steps["eval/choices/score"]) == [0, 2, STEPS]
    at_end = {m.name: m.value for m in recorded if m.step == STEPS}

    # The same suites through `rollout eval`, on the final checkpoint, in one process.
    eval_config = suites_dir / "suites.eval.toml"
    eval_config.write_text(
        "".join(
            "[[suites]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in suite.items())
            for suite in SUITES
        )
    )
    checkpoint = workdir / "runs" / run.run_id / "checkpoints" / f"step-{STEPS:06d}"
    report = workdir / "report.json"
    scored = rollout(
        workdir,
        "eval",
        "--config",
        str(eval_config),
        "--checkpoint",
        str(checkpoint),
        "--report",
        str(report),
    )
    assert scored.returncode == 0, scored.stdout + scored.stderr
    expected = {}
    for suite in json.loads(report.read_text())["suites"]:
        for name, value in suite["metrics"].items():
            if value is not None:
                expected[f"eval/{suite['name']}/{name}"] = value
        for category, entry in suite["categories"].items():
            for name, value in entry["metrics"].items():
                if value is not None:
                    expected[f"eval/{suite['name']}/{category}/{name}"] = value
    assert set(expected) == set(at_end)
    for name, value in expected.items():
        assert at_end[name] == pytest.approx(value, abs=1e-9), name
    # The digest differs between completions: a constant would make this comparison empty.
    assert 0 < at_end["eval/digest/score"] < 1


def test_a_changed_suite_file_makes_the_plan_stale(workdir: Path, suites_dir: Path) -> None:
    settings = _settings()[1::2]
    plan = plan_with(workdir, "examples/grpo-tiny.toml", *settings)
    with (suites_dir / "mmlu.jsonl").open("a") as file:
        file.write(json.dumps(MMLU[0]) + "\n")
    refused = rollout(workdir, "run", "--plan", str(plan))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "eval.suites[2].data" in refused.stderr + refused.stdout
    assert "changed since planning" in refused.stderr + refused.stdout


def test_a_suite_row_without_its_field_is_refused_at_plan(workdir: Path, suites_dir: Path) -> None:
    rows = [GSM8K[0], {"prompt": "no answer here"}]
    (suites_dir / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    refused = rollout(workdir, "plan", "--config", "examples/grpo-tiny.toml", *_settings())
    output = refused.stdout + refused.stderr
    assert refused.returncode == 2, output
    assert "Traceback" not in output
    assert re.search(
        r"eval\.suites\[0\]\.data: record 2 \(line 2\) of \S+gsm8k\.jsonl: field 'answer' missing",
        output,
    ), output
