"""A GRPO run from a model named by Hub id (`model.hub`), read from a Hugging Face cache the test
lays out (tests/conftest.py hub_cache); nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from rollout.planner.lockfile import read_plan
from tests.conftest import COMMITS, HUB_ID
from tests.integration.driver import only_run, rollout

pytestmark = pytest.mark.slow


def test_grpo_trains_from_a_hub_model_in_the_cache(workdir, hub_cache):
    snapshot = hub_cache.add()
    result = rollout(
        workdir,
        "run",
        "--config",
        "examples/grpo-tiny.toml",
        "--set",
        "model.builtin=null",
        "--set",
        f"model.hub={HUB_ID}",
        "--set",
        "algorithm.max_steps=2",
        "--set",
        "checkpoint.interval=2",
        "--set",
        "data.eval=null",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    store, record = only_run(workdir)
    assert record.status == "finished" and record.last_step == 2

    plan = read_plan(record.plan_path, check_fresh=False)
    assert (plan.model.source, plan.model.commit) == ("hub", COMMITS[0])
    assert plan.model.location == str(snapshot)
    # The workers loaded the snapshot (weights and tokenizer), not a builtin model of their own.
    assert not (workdir / "cache" / "models").exists()

    start = load_file(snapshot / "model.safetensors")
    final = load_file(
        Path(store.checkpoints(record.run_id)[-1].location) / "model" / "model.safetensors"
    )
    changed = [name for name in start if not (start[name] == final[name]).all()]
    assert len(changed) > len(start) // 2

    # A later download moves refs/main: the run's plan is stale and refused.
    hub_cache.add(commit=COMMITS[1])
    again = rollout(workdir, "run", "--plan", record.plan_path)
    assert again.returncode == 2, again.stdout + again.stderr
    assert (
        f"model.hub: {HUB_ID} revision 'main' moved since planning" in again.stdout + again.stderr
    )
