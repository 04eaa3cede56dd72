"""A real GRPO run (the CLI, torchrun, the tiny model) with its reward in a sidecar scores what
the same run scores in-process, and leaves no sidecar behind."""

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


def _run(tmp_path: Path, isolation: str) -> dict[str, dict[int, float]]:
    workdir = tmp_path / isolation
    workdir.mkdir()
    shutil.copytree(EXAMPLES, workdir / "examples")
    (workdir / "examples" / "varied.py").write_text(VARIED_REWARD)
    reward = f"{{ fn = './varied.py:length', isolation = '{isolation}' }}"
    planned = rollout(
        workdir,
        "plan",
        *("--config", "examples/grpo-tiny.toml", "-o", "plan.lock"),
        *("--set", f"algorithm.max_steps={STEPS}"),
        *("--set", f"rewards=[{reward}]"),
        *("--set", "data.eval=null"),
        *("--set", "checkpoint.interval=null"),
    )
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert read_plan(workdir / "plan.lock").rewards[0].isolation == isolation
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
    in_process = _run(tmp_path, "in_process")
    sidecar = _run(tmp_path, "sidecar")
    assert in_process["reward/length"] and len(in_process["reward/length"]) == STEPS
    assert sidecar == in_process
    assert processes_mentioning("rollout.plugins.sidecar.server") == []
