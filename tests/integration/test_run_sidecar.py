"""Real GRPO runs (the CLI, torchrun, the tiny model) with a reward, or a multi-turn environment,
in a sidecar score what the same runs score in-process, and leave no sidecar behind."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rollout.planner.lockfile import read_plan
from tests.conftest import EXAMPLES
from tests.integration.driver import only_run, processes_mentioning, rollout

pytestmark = pytest.mark.slow

STEPS = 2

VARIED_REWARD = """
def length(prompts, completions, **_):
    # Completions score apart, so the runs' rewards are worth comparing.
    return [len(c) / 100 for c in completions]
"""

CRASHY_REWARD = """
import os
import signal


def crashy(prompts, completions, **_):
    if any(len(c) % 3 == 0 for c in completions):
        os.kill(os.getpid(), signal.SIGSEGV)  # the completions the model happens to write
    return [len(c) / 100 for c in completions]
"""


SEVENS_GAME = """
from rollout.harness.environments.base import StepResult


class SevensGame:
    def reset(self, rows, *, seed):
        return [str(row["prompt"]) for row in rows]

    def step(self, episodes, actions):
        return [StepResult("More sevens.", reward=a.count("7") / max(1, len(a)) + len(a) / 100)
                for a in actions]
"""


def _run(tmp_path: Path, name: str, *settings: str) -> dict[str, dict[int, float]]:
    """A short run of grpo-tiny with `settings`; its reward metrics by step."""
    workdir = tmp_path / name
    workdir.mkdir()
    shutil.copytree(EXAMPLES, workdir / "examples")
    (workdir / "examples" / "varied.py").write_text(VARIED_REWARD)
    (workdir / "examples" / "crashy.py").write_text(CRASHY_REWARD)
    (workdir / "examples" / "games.py").write_text(SEVENS_GAME)
    args = ["plan", "--config", "examples/grpo-tiny.toml", "-o", "plan.lock"]
    for setting in (
        f"algorithm.max_steps={STEPS}",
        "data.eval=null",
        "checkpoint.interval=null",
        *settings,
    ):
        args += ["--set", setting]
    planned = rollout(workdir, *args)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    result = rollout(workdir, "run", "--plan", "plan.lock", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    store, record = only_run(workdir)
    assert record.status == "finished" and record.last_step == STEPS
    metrics: dict[str, dict[int, float]] = {}
    for row in store.metrics(record.run_id):
        if row.name.startswith("reward/"):
            metrics.setdefault(row.name, {})[row.step] = row.value
    store.close()
    return metrics


def test_a_sidecar_reward_scores_a_run_as_the_function_does_in_process(tmp_path):
    runs = {}
    for isolation in ("in_process", "sidecar"):
        reward = f"{{ fn = './varied.py:length', isolation = '{isolation}' }}"
        runs[isolation] = _run(tmp_path, isolation, f"rewards=[{reward}]")
        plan = read_plan(tmp_path / isolation / "plan.lock")
        assert plan.rewards[0].isolation == isolation
    assert len(runs["in_process"]["reward/length"]) == STEPS
    assert runs["sidecar"] == runs["in_process"]
    assert processes_mentioning("rollout.plugins.sidecar.server") == []


def test_a_reward_that_crashes_on_some_samples_fails_only_those_and_the_run_goes_on(tmp_path):
    """on_error = "fail_sample": each batch is bisected to the completions the sidecar crashes
    on; they score failure_score and are counted, the run finishes."""
    reward = (
        "{ fn = './crashy.py:crashy', isolation = 'sidecar', timeout_s = 5, "
        "on_error = 'fail_sample', failure_score = -1.0 }"
    )
    metrics = _run(tmp_path, "crashy", f"rewards=[{reward}]")
    failed = metrics["reward/crashy/failed"]
    assert sorted(failed) == list(range(1, STEPS + 1)) and sum(failed.values()) > 0
    assert all(value >= -1.0 for value in metrics["reward/crashy"].values())
    assert processes_mentioning("rollout.plugins.sidecar.server") == []


def test_a_sidecar_environment_plays_a_run_as_it_does_in_process(tmp_path):
    runs = {}
    for isolation in ("in_process", "sidecar"):
        runs[isolation] = _run(
            tmp_path,
            f"env-{isolation}",
            "rewards=[]",
            "environment.name='./games.py:SevensGame'",
            "environment.max_turns=2",
            "environment.max_observation_tokens=24",
            f"environment.isolation='{isolation}'",
        )
        plan = read_plan(tmp_path / f"env-{isolation}" / "plan.lock")
        assert plan.config.environment.isolation == isolation
    assert len(runs["in_process"]["reward/mean"]) == STEPS
    assert all(value > 0 for value in runs["in_process"]["reward/mean"].values())
    assert runs["sidecar"] == runs["in_process"]
    assert processes_mentioning("rollout.plugins.sidecar.server") == []
