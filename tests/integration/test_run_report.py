"""A real tiny GRPO run records sample completions, and `rollout report` turns the run into a
page: colocated, and with the actor and learner on processes of their own (samples cross to the
learner on the rollout batch). Each run takes 20-60 s on 2 cores, so they are marked slow."""

from __future__ import annotations

import json
import re

import pytest

from tests.integration.driver import only_run, rollout

pytestmark = pytest.mark.slow


def _run_and_report(workdir, *settings: str) -> tuple[dict, list]:
    args = ["run", "--config", "examples/grpo-tiny.toml", "--set", "algorithm.max_steps=3"]
    args += ["--set", 'data.eval={ path = "data/arith-eval.jsonl", limit = 4 }']
    for setting in settings:
        args += ["--set", setting]
    result = rollout(workdir, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    store, record = only_run(workdir)
    samples = store.samples(record.run_id)
    store.close()
    made = rollout(workdir, "report", record.run_id, "--out", "report")
    assert made.returncode == 0, made.stdout + made.stderr
    page = (workdir / "report" / "index.html").read_text()
    data = re.search(r'<script id="report-data" type="application/json">(.*?)</script>', page, re.S)
    return json.loads(data.group(1)), samples


def test_a_grpo_run_records_samples_and_reports(workdir):
    data, samples = _run_and_report(workdir, "logging.samples_per_step=3")
    # 2 prompts x 4 generations a step; the first 3 recorded, at each of the 3 steps.
    assert [(s.step, s.index) for s in samples] == [(st, i) for st in (1, 2, 3) for i in range(3)]
    first = samples[0]
    assert first.prompt and first.completion is not None and first.turns is None
    assert set(first.extra["rewards"]) == {"numeric_match", "brevity"}
    # The recorded reward is the weighted sum of the reward functions.
    rewards = first.extra["rewards"]
    assert first.reward == pytest.approx(rewards["numeric_match"] + 0.1 * rewards["brevity"])
    assert data["run"]["status"] == "finished"
    assert [p[0] for p in data["series"]["reward/mean"]["points"]] == [1, 2, 3]
    assert "eval/reward" in data["series"] and data["breakdown"]["phases"]
    assert len(data["samples"]["rows"]) == 9
    assert data["plan"]["facts"]["algorithm"] == "grpo"


def test_a_split_run_records_the_actor_samples(workdir):
    data, samples = _run_and_report(
        workdir,
        "cluster.nproc_per_node=2",
        "cluster.placement={ actor = [0], learner = [1] }",
        "data.eval=null",
    )
    assert [(s.step, s.index) for s in samples] == [(st, i) for st in (1, 2, 3) for i in range(4)]
    assert all(s.completion is not None for s in samples)
    assert "perf/receive_s" in data["breakdown"]["phases"]


def test_a_multi_turn_run_records_its_episodes(workdir):
    """guess_number on the tiny model: each sample is an episode's messages, answers and the
    environment's replies in turn, its reward the episode's return."""
    args = ["run", "--config", "examples/guess-number.toml"]
    for setting in (
        'model={ builtin = "tiny-llama" }',
        "data.system_prompt=null",
        "data.eval=null",
        "run.eval_interval=null",
        "algorithm.max_steps=2",
        "algorithm.rollout_batch_size=8",
        "algorithm.num_generations=4",
        "algorithm.minibatch_size=8",
        "logging.samples_per_step=2",
    ):
        args += ["--set", setting]
    result = rollout(workdir, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    store, record = only_run(workdir)
    samples = store.samples(record.run_id)
    store.close()
    assert [(s.step, s.index) for s in samples] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for sample in samples:
        assert sample.completion is None and sample.prompt.startswith("Guess my number")
        roles = [turn["role"] for turn in sample.turns]
        assert roles[0] == "assistant" and roles[1::2] == ["user"] * len(roles[1::2])
        assert len(roles) == 2 * len(sample.extra["turn_rewards"]) - 1 or sample.extra["solved"]
        assert sample.reward == sum(sample.extra["turn_rewards"])
    made = rollout(workdir, "report", record.run_id, "--out", "report")
    assert made.returncode == 0, made.stdout + made.stderr
    assert '"turns":[{"role":"assistant"' in (workdir / "report" / "index.html").read_text()
