"""`rollout plugins list / test / new` as a user meets them: real plugin files, sample files, an
installed distribution (a dist-info folder), scaffolds whose own tests run in a child pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.plugins.registry import KINDS
from tests.conftest import EXAMPLES, REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

runner = CliRunner()


@pytest.fixture(autouse=True)
def forget_tmp_modules(tmp_path):
    """Modules imported from this test's tmp_path must not leak into the next test."""
    yield
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve().is_relative_to(tmp_path.resolve()):
            del sys.modules[name]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def jsonl(path: Path, items: list[dict]) -> Path:
    return write(path, "".join(json.dumps(item) + "\n" for item in items))


def plugins(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["plugins", *map(str, args)])
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def trial(*args: str) -> dict:
    code, output = plugins("test", *args, "--format", "json")
    assert code == 0, output
    return json.loads(output)


ROWS = [
    {"prompt": "What is 2+2?", "completion": "It is 4.", "answer": "4"},
    {"prompt": "What is 3+3?", "completion": "Maybe 7.", "answer": "6"},
]

REWARDS = """
import time

def length(prompts, completions, answer, scale=1.0):
    return [scale * len(c) for c in completions]

def boom(prompts, completions, **kwargs):
    return {}["missing"]

def one(prompts, completions, **kwargs):
    return [1.0]

def hang(prompts, completions, **kwargs):
    time.sleep(3600)
"""


# ---------------------------------------------------------------------------------------------
# list


def test_list_shows_builtins_of_every_kind(tmp_path):
    code, output = plugins("list", "--format", "json")
    assert code == 0, output
    listed = json.loads(output)
    assert {row["kind"] for row in listed} == set(KINDS)
    assert {"kind": "reward", "name": "numeric_match", "source": "builtin"}.items() <= next(
        row for row in listed if row["name"] == "numeric_match"
    ).items()


def test_list_shows_an_installed_entry_point_and_filters_by_kind(tmp_path, monkeypatch):
    site = tmp_path / "site"
    write(site / "acme.py", "def score(prompts, completions, **kw):\n    return [0.0]\n")
    info = site / "acme_rewards-1.4.dist-info"
    write(info / "METADATA", "Metadata-Version: 2.1\nName: acme-rewards\nVersion: 1.4\n")
    write(info / "entry_points.txt", "[rollout.rewards]\nacme_score = acme:score\n")
    monkeypatch.syspath_prepend(str(site))
    code, output = plugins("list", "--kind", "reward")
    assert code == 0, output
    (line,) = [line for line in output.splitlines() if "acme_score" in line]
    assert line.split() == ["reward", "acme_score", "entry", "point", "acme-rewards", "1.4"]
    assert "tracker" not in output


def test_list_refuses_an_unknown_kind():
    code, output = plugins("list", "--kind", "rewards")
    assert code == 2
    assert "no plugin kind 'rewards'" in output and "reward, environment" in output


# ---------------------------------------------------------------------------------------------
# test: rewards


def test_a_builtin_reward_is_run_on_the_sample(tmp_path):
    sample = jsonl(tmp_path / "s.jsonl", ROWS)
    report = trial("numeric_match", "--kind", "reward", "--sample", sample)
    (call,) = report["calls"]
    assert call["result"] == [1.0, 0.0]
    assert call["items"] == 2 and call["seconds"] >= 0
    assert report["identity"]["kind"] == "builtin"


def test_the_readme_example_scores_the_example_reward():
    sample = EXAMPLES / "rewards.sample.jsonl"
    report = trial(
        "./rewards.py:brevity", "--kind", "reward", "--sample", sample,
        "--config-dir", EXAMPLES,
    )  # fmt: skip
    sys.path.insert(0, str(EXAMPLES))
    try:
        from rewards import brevity
    finally:
        sys.path.remove(str(EXAMPLES))
        sys.modules.pop("rewards", None)
    rows = [json.loads(line) for line in sample.read_text().splitlines()]
    expected = brevity([r["prompt"] for r in rows], [r["completion"] for r in rows])
    assert report["calls"][0]["result"] == expected
    assert len(set(expected)) > 1  # the sample tells a short answer from a long one


def test_a_file_reward_gets_its_fields_and_options_and_the_text_shows_timings(tmp_path):
    write(tmp_path / "rewards.py", REWARDS)
    sample = jsonl(tmp_path / "s.jsonl", ROWS)
    report = trial(
        "./rewards.py:length", "--kind", "reward", "--sample", sample,
        "--config-dir", tmp_path, "--options", '{"scale": 2}',
    )  # fmt: skip
    assert report["calls"][0]["result"] == [2.0 * len(r["completion"]) for r in ROWS]
    assert report["identity"]["kind"] == "file" and report["identity"]["sha256"]
    code, output = plugins(
        "test", "./rewards.py:length", "--kind", "reward", "--sample", sample,
        "--config-dir", tmp_path,
    )  # fmt: skip
    assert code == 0, output
    assert "per item" in output and "score 2 completions" in output
    assert str([float(len(r["completion"])) for r in ROWS]) in output


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("./rewards.py:boom", "reward './rewards.py:boom' raised KeyError: 'missing' at"),
        ("./rewards.py:one", "returned 1 values for 2 completions"),
        ("./rewards.py:hang", "did not return within 0.5 s for 2 completions"),
        ("./rewards.py:lenght", "has no attribute 'lenght'"),
    ],
)
def test_a_failing_reward_is_one_error_naming_it_and_the_sample(tmp_path, ref, expected):
    write(tmp_path / "rewards.py", REWARDS)
    sample = jsonl(tmp_path / "s.jsonl", ROWS)
    code, output = plugins(
        "test", ref, "--kind", "reward", "--sample", sample, "--config-dir", tmp_path,
        "--timeout-s", "0.5",
    )  # fmt: skip
    assert code == 2, output
    assert expected in " ".join(output.split())
    assert output.count("error") == 1


def test_a_reward_that_fails_to_import_names_its_file_and_line(tmp_path):
    write(tmp_path / "broken.py", "import json\nraise ValueError('bad config')\n")
    sample = jsonl(tmp_path / "s.jsonl", ROWS)
    code, output = plugins(
        "test", "./broken.py:score", "--kind", "reward", "--sample", sample,
        "--config-dir", tmp_path,
    )  # fmt: skip
    assert code == 2
    assert "raised ValueError: bad config" in output and "broken.py:2" in output


def test_a_reward_whose_required_field_is_not_in_the_sample_is_refused(tmp_path):
    sample = jsonl(tmp_path / "s.jsonl", [{"prompt": "p", "completion": "c"}])
    code, output = plugins("test", "numeric_match", "--kind", "reward", "--sample", sample)
    assert code == 2
    assert "'answer'" in output


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"prompt": "p", "completion": "c"}\n{"prompt": "p"\n', "s.jsonl:2: is not valid JSON"),
        ('{"prompt": "p"}\n', "s.jsonl:1: 'completion' is missing"),
        ("[1, 2]\n", "is int, not a JSON object"),
        ("", "has no items"),
        ('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}\n", "s.jsonl:1: nests arrays or objects"),
        ('{"prompt": ' + "9" * 5000 + "}\n", "s.jsonl:1: holds a number too long"),
    ],
)
def test_a_malformed_sample_names_the_line(tmp_path, content, expected):
    path = tmp_path / "s.jsonl"
    path.write_text(content)
    if content.startswith("["):
        path = path.rename(tmp_path / "s.json")
    code, output = plugins("test", "exact_match", "--kind", "reward", "--sample", path)
    assert code == 2
    assert expected in " ".join(output.split())


# ---------------------------------------------------------------------------------------------
# test: environments, tools, scorers, and the kinds it cannot try

ENVIRONMENT = """
from rollout.harness.environments.base import StepResult

class Countdown:
    def __init__(self, start=2):
        self.start = start
    def reset(self, rows, *, seed):
        self.left = [self.start] * len(rows)
        return [f"count down from {row['n']}" for row in rows]
    def step(self, episodes, actions):
        out = []
        for episode, action in zip(episodes, actions):
            self.left[episode] -= 1
            out.append(StepResult(observation=action.upper(), reward=1.0,
                                  done=self.left[episode] == 0))
        return out

def not_an_environment():
    return {"reset": None}

class Sloppy(Countdown):
    def step(self, episodes, actions):
        return ["not a StepResult" for _ in episodes]
"""


def test_an_environment_is_reset_then_stepped_until_its_episodes_end(tmp_path):
    write(tmp_path / "envs.py", ENVIRONMENT)
    sample = write(
        tmp_path / "episodes.json",
        json.dumps(
            [
                {"row": {"n": 3}, "actions": ["two", "one", "never sent"]},
                {"row": {"n": 5}, "actions": ["four"]},
            ]
        ),
    )
    report = trial(
        "./envs.py:Countdown", "--kind", "environment", "--sample", sample,
        "--config-dir", tmp_path,
    )  # fmt: skip
    reset, first, second = report["calls"]
    assert reset["result"] == ["count down from 3", "count down from 5"]
    assert first["items"] == 2 and first["result"]["0"]["observation"] == "TWO"
    # episode 1 ran out of actions; episode 0 ended after its second step (start=2)
    assert second["items"] == 1 and second["result"]["0"]["done"] is True


def test_a_factory_that_builds_no_environment_is_refused_naming_the_protocol(tmp_path):
    write(tmp_path / "envs.py", ENVIRONMENT)
    sample = jsonl(tmp_path / "episodes.jsonl", [{"row": {"n": 1}, "actions": ["a"]}])
    code, output = plugins(
        "test", "./envs.py:not_an_environment", "--kind", "environment", "--sample", sample,
        "--config-dir", tmp_path,
    )  # fmt: skip
    assert code == 2
    text = " ".join(output.split())
    assert "returned dict" in text
    assert "rollout.harness.environments.base.Environment Protocol" in text


def test_an_environment_returning_the_wrong_shape_names_the_episodes_sample(tmp_path):
    write(tmp_path / "envs.py", ENVIRONMENT)
    sample = jsonl(tmp_path / "episodes.jsonl", [{"row": {"n": 1}, "actions": ["a"]}])
    code, output = plugins(
        "test", "./envs.py:Sloppy", "--kind", "environment", "--sample", sample,
        "--config-dir", tmp_path,
    )  # fmt: skip
    assert code == 2
    text = " ".join(output.split())
    assert "episodes.jsonl:1" in text and "environment './envs.py:Sloppy'" in text
    assert "is str, not a StepResult" in text


TOOLS = """
from rollout.harness.tools import ToolError

def divide(a, b):
    if b == 0:
        raise ToolError("b must not be 0")
    return a / b

divide.schema = {"name": "divide", "description": "a / b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"]}}

def crash(a, b):
    raise RuntimeError("a bug")

crash.schema = dict(divide.schema, name="crash")
"""


def test_a_function_tool_is_called_with_each_items_arguments(tmp_path):
    write(tmp_path / "tools.py", TOOLS)
    sample = jsonl(tmp_path / "calls.jsonl", [{"a": 6, "b": 3}, {"a": 1, "b": 0}])
    report = trial(
        "./tools.py:divide", "--kind", "tool", "--sample", sample, "--config-dir", tmp_path
    )
    # a ToolError is the tool answering the model, not a failure
    assert [call["result"] for call in report["calls"]] == ["2.0", "error: b must not be 0"]


@pytest.mark.parametrize(
    ("ref", "arguments", "expected"),
    [
        ("./tools.py:crash", {"a": 1, "b": 2}, "the call raised RuntimeError: a bug"),
        ("./tools.py:divide", {"a": "x", "b": 2}, "the arguments do not fit the tool 'divide'"),
    ],
)
def test_a_failing_tool_call_names_the_sample(tmp_path, ref, arguments, expected):
    write(tmp_path / "tools.py", TOOLS)
    sample = jsonl(tmp_path / "calls.jsonl", [arguments])
    code, output = plugins(
        "test", ref, "--kind", "tool", "--sample", sample, "--config-dir", tmp_path
    )
    assert code == 2
    assert "calls.jsonl:1" in output and expected in " ".join(output.split())


def test_a_builtin_tool_is_built_with_its_options(tmp_path):
    sample = jsonl(tmp_path / "calls.jsonl", [{"expression": "6*7"}])
    report = trial("calculator", "--kind", "tool", "--sample", sample)
    assert report["calls"][0]["result"] == "42"


def test_scorers_builtin_and_plugin(tmp_path):
    write(tmp_path / "scorers.py", "def half(record, completion):\n    return 0.5\n"
          "def big(record, completion):\n    return 2.0\n")  # fmt: skip
    sample = jsonl(tmp_path / "rows.jsonl", [dict(ROWS[0], completion="The answer is 4")])
    report = trial("gsm8k", "--kind", "scorer", "--sample", sample)
    assert report["calls"][0]["result"]["correct"] is True
    report = trial(
        "./scorers.py:half", "--kind", "scorer", "--sample", sample, "--config-dir", tmp_path
    )
    assert report["calls"][0]["result"]["value"] == 0.5
    code, output = plugins(
        "test", "./scorers.py:big", "--kind", "scorer", "--sample", sample,
        "--config-dir", tmp_path,
    )  # fmt: skip
    assert code == 2
    assert "rows.jsonl:1" in output and "not a score in [0, 1]" in output


ENGINES = """
import dataclasses

from rollout.engines.plugin import WrappedEngine


class Marked(WrappedEngine):
    \"\"\"The built-in hf engine, every completion's text marked.\"\"\"

    def generate(self, prompts, params):
        return [
            dataclasses.replace(c, text="[marked]" + c.text)
            for c in self.inner.generate(prompts, params)
        ]


def make(spec):
    return Marked(spec.hf_engine())


class Short(Marked):
    def generate(self, prompts, params):
        return self.inner.generate(prompts, params)[:-1]  # one completion too few


def short(spec):
    return Short(spec.hf_engine())


def nothing(spec):
    return 42
"""


def test_an_engine_plugin_generates_for_each_prompt_on_the_tiny_model(tmp_path):
    write(tmp_path / "engines.py", ENGINES)
    sample = jsonl(tmp_path / "prompts.jsonl", [{"prompt": "1+1="}, {"prompt": "2+2=", "n": 2}])
    report = trial("./engines.py:make", "--kind", "engine", "--sample", sample,
                   "--config-dir", tmp_path)  # fmt: skip
    assert report["identity"]["kind"] == "file" and report["identity"]["sha256"]
    labels = [call["label"] for call in report["calls"]]
    assert labels == ["load builtin:tiny-llama", "build", "generate 1", "generate 2"]
    first, second = report["calls"][2]["result"], report["calls"][3]["result"]
    assert len(first) == 1 and len(second) == 2
    assert all(c["text"].startswith("[marked]") and 1 <= c["tokens"] <= 16 for c in first + second)


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("./engines.py:short", "returned 1 completions, asked for n=2"),
        ("./engines.py:nothing", "returned a int, which has no generate(), load_weights()"),
        ("./engines.py:absent", "has no attribute 'absent'"),
        ("hf", "is a built-in engine"),
    ],
)
def test_a_wrong_engine_plugin_is_one_error(tmp_path, ref, expected):
    write(tmp_path / "engines.py", ENGINES)
    sample = jsonl(tmp_path / "prompts.jsonl", [{"prompt": "1+1=", "n": 2}])
    code, output = plugins("test", ref, "--kind", "engine", "--sample", sample,
                           "--config-dir", tmp_path)  # fmt: skip
    assert code == 2, output
    assert expected in " ".join(output.split()), output


def test_only_an_engine_is_tried_on_a_model(tmp_path):
    sample = jsonl(tmp_path / "s.jsonl", ROWS)
    code, output = plugins("test", "exact_match", "--kind", "reward", "--sample", sample,
                           "--model", "builtin:tiny-llama")  # fmt: skip
    assert code == 2
    assert "only an engine plugin is tried on a model" in output


TRACKERS = """
import os


class Rows:
    def __init__(self, run_dir):
        self.path = os.path.join(run_dir, "rows.txt")

    def log(self, rows):
        with open(self.path, "a") as file:
            file.write("".join(f"{r.step} {r.name} {r.value}\\n" for r in rows))

    def close(self):
        self.closed = True


def make(run_id, run_dir):
    return Rows(run_dir)


def nothing(run_id, run_dir):
    return 42


def boom(run_id, run_dir):
    raise ConnectionError("no route to the dashboard")
"""

METRIC_ROWS = [
    {"step": 1, "name": "reward/mean", "value": 0.25},
    {"step": 2, "name": "x", "value": 1},
]


def test_a_tracker_plugin_is_built_fed_the_rows_and_closed(tmp_path):
    write(tmp_path / "trackers.py", TRACKERS)
    sample = jsonl(tmp_path / "rows.jsonl", METRIC_ROWS)
    report = trial("./trackers.py:make", "--kind", "tracker", "--sample", sample,
                   "--config-dir", tmp_path)  # fmt: skip
    build, log, close = report["calls"]
    assert build["result"] == "Rows" and log["items"] == 2
    assert close["result"] == {"files written in run_dir": ["rows.txt"]}


@pytest.mark.parametrize(
    ("ref", "rows", "expected"),
    [
        ("./trackers.py:nothing", METRIC_ROWS, "returned a int, which has no log() or close()"),
        ("./trackers.py:boom", METRIC_ROWS, "ConnectionError: no route to the dashboard"),
        ("./trackers.py:make", [{"step": 1.5, "name": "a", "value": 1}], "rows.jsonl:1"),
        ("jsonl", METRIC_ROWS, "is a built-in tracker"),
    ],
)
def test_a_failing_tracker_or_row_is_one_error(tmp_path, ref, rows, expected):
    write(tmp_path / "trackers.py", TRACKERS)
    sample = jsonl(tmp_path / "rows.jsonl", rows)
    code, output = plugins("test", ref, "--kind", "tracker", "--sample", sample,
                           "--config-dir", tmp_path)  # fmt: skip
    assert code == 2 and expected in output, output
    assert "Traceback" not in output


# ---------------------------------------------------------------------------------------------
# new


@pytest.mark.parametrize(
    "kind",
    [
        "reward",
        "environment",
        "tool",
        "scorer",
        "tracker",
        pytest.param("engine", marks=pytest.mark.slow),  # loads the tiny model three times
    ],
)
def test_new_scaffolds_a_package_whose_test_passes_and_whose_entry_point_is_found(tmp_path, kind):
    target = tmp_path / "pkg"
    code, output = plugins("new", kind, "acme_thing", "--dir", target)
    assert code == 0, output
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # its own test, as its author runs it: pytest in the package (pyproject puts src on the path)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=target, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
    # "installed": a dist-info beside the package with the pyproject's entry points
    project = tomllib.loads((target / "pyproject.toml").read_text())["project"]
    ((group, entries),) = project["entry-points"].items()
    assert group == KINDS[kind].group
    info = target / "src" / "acme_thing-0.1.0.dist-info"
    write(info / "METADATA", "Metadata-Version: 2.1\nName: acme-thing\nVersion: 0.1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entries.items())
    write(info / "entry_points.txt", f"[{group}]\n{lines}")
    env["PYTHONPATH"] = os.pathsep.join([str(target / "src"), str(REPO)])
    rollout = [sys.executable, "-m", "rollout", "plugins"]
    listed = subprocess.run(
        [*rollout, "list", "--kind", kind, "--format", "json"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert {
        "name": "acme_thing",
        "source": "entry point acme-thing",
        "version": "0.1.0",
    }.items() <= (
        next(row for row in json.loads(listed.stdout) if row["name"] == "acme_thing").items()
    )
    # and it runs on its own sample, found by its name alone
    tried = subprocess.run(
        [*rollout, "test", "acme_thing", "--kind", kind, "--sample", target / "sample.jsonl"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert tried.returncode == 0, tried.stdout + tried.stderr
    assert "call(s)" in tried.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["reward", "my-reward"], "is not a valid Python identifier"),
        (["reward", "class"], "is not a valid Python identifier"),
        (["reward", "json"], "existing module"),
        (["reward", "exact_match"], "is a built-in reward"),
        (["engine", "hf"], "is a built-in engine"),
        (["widget", "w"], "no plugin kind 'widget'"),
    ],
)
def test_new_refuses_bad_names_and_kinds(tmp_path, args, expected):
    code, output = plugins("new", *args, "--dir", tmp_path / "out")
    assert code == 2
    assert expected in output
    assert not (tmp_path / "out").exists()


def test_new_refuses_a_directory_in_use(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    code, output = plugins("new", "reward", "fine", "--dir", tmp_path)
    assert code == 2
    assert "is not an empty directory" in output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
