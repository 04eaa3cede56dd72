"""Engine plugins end to end: a file plugin that wraps the hf engine runs a tiny GRPO run from
`rollout plan` to `rollout run`, its identity in plan.lock and an edit making the plan stale;
references that cannot work are one error at plan (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout.planner.lockfile import read_plan
from tests.integration.driver import only_run, plan_with, rollout

# Wraps the built-in hf engine, marks every completion's text, and counts its calls in a file
# beside itself (the run's processes share the working directory's examples/).
MARKING_ENGINE = """
import dataclasses
import os

from rollout.engines.plugin import WrappedEngine

CALLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine-calls.txt")


class Marking(WrappedEngine):
    def generate(self, prompts, params):
        with open(CALLS, "a") as file:
            file.write(f"{len(prompts)} {params.n}\\n")
        return [
            dataclasses.replace(c, text="[marked]" + c.text)
            for c in self.inner.generate(prompts, params)
        ]


def make(spec):
    return Marking(spec.hf_engine())


class Widget:
    def generate(self, prompts, params):
        return []


def widget(spec) -> Widget:
    return Widget()


def make_two(spec, other):
    return Marking(spec.hf_engine())
"""

CONFIG = "examples/grpo-tiny.toml"
SHORT = ("algorithm.max_steps=2", "data.eval.limit=4", "generation.engine=./engine.py:make")


@pytest.mark.slow
def test_a_file_engine_plugin_runs_a_grpo_run_and_is_in_plan_lock(workdir):
    engine_file = workdir / "examples" / "engine.py"
    engine_file.write_text(MARKING_ENGINE)
    plan_path = plan_with(workdir, CONFIG, *SHORT)
    plan = read_plan(plan_path)
    assert plan.engine is not None
    assert plan.engine.kind == "file" and plan.engine.used_by == "generation.engine"
    assert plan.engine.path == str(engine_file.resolve()) and plan.engine.sha256
    assert plan.engine in plan.plugins

    ran = rollout(workdir, "run", "--plan", "plan.lock", timeout=600)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    store, record = only_run(workdir)
    assert record.status == "finished"
    calls = (workdir / "examples" / "engine-calls.txt").read_text().splitlines()
    assert len(calls) >= 2  # every training step's rollout (and the evaluation) went through it
    samples = store.samples(record.run_id)
    assert samples and all("[marked]" in json.dumps(sample.completion) for sample in samples)

    # an edit to the plugin file makes the plan stale: refused, with the file named
    engine_file.write_text(MARKING_ENGINE + "\n# edited\n")
    stale = rollout(workdir, "run", "--plan", "plan.lock")
    assert stale.returncode == 2
    assert "engine.py changed since planning" in " ".join(stale.stderr.split())


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("./engine.py:absent", "has no attribute 'absent'"),
        ("./missing_engine.py:make", "plugin file './missing_engine.py' not found"),
        ("no_such_engine_pkg.mod:make", "module 'no_such_engine_pkg.mod' not found"),
        ("./engine.py:widget", "it builds a Widget, which has no load_weights(), close()"),
        ("./engine.py:make_two", "cannot be called as make(spec)"),
        ("no_such_engine", "no built-in and no installed entry point in group 'rollout.engines'"),
    ],
)
def test_a_bad_engine_reference_is_one_error_at_plan(workdir, ref, expected):
    (workdir / "examples" / "engine.py").write_text(MARKING_ENGINE)
    planned = rollout(
        workdir, "plan", "--config", CONFIG, "-o", "plan.lock", "--set", f"generation.engine={ref}"
    )
    assert planned.returncode == 2, planned.stdout + planned.stderr
    output = " ".join((planned.stdout + planned.stderr).split())
    assert "generation.engine" in output and expected in output, output
    assert "Traceback" not in output
    assert not Path(workdir / "plan.lock").exists()
