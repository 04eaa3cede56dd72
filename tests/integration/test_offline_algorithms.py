"""DPO, IPO, KTO, SFT and reward models through the real CLI and torchrun, learning on the tiny
model: margins grow and held-out accuracy beats chance, held-out SFT loss falls, a killed run
resumes without repeating a batch, and a trained reward model rewards a GRPO run.

The data (examples/data/glued-*.jsonl, judged-*.jsonl, sft-*.jsonl) is built so that a tiny random
model can learn it: the sum preferred over the operands glued together. Each run takes 10-30 s
here (most of it starting Python and torch), so they are marked slow.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rollout.models.builtin_build import build_tiny
from rollout.planner.lockfile import read_plan
from rollout.storage import open_store
from tests.integration.driver import environment, rollout

pytestmark = pytest.mark.slow


def run_example(workdir: Path, name: str, *overrides: str):
    args = ["run", "--config", f"examples/{name}"]
    for override in overrides:
        args += ["--set", override]
    result = rollout(workdir, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    store = open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False)
    record = next(r for r in store.list_runs() if r.name == name.removesuffix(".toml"))
    assert record.status == "finished"
    return store, record, result.stdout


def series(store, run_id: str, name: str) -> list[float]:
    return [m.value for m in sorted(store.metrics(run_id, [name]), key=lambda m: m.step)]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.parametrize("example", ["dpo-tiny.toml", "ipo-tiny.toml"])
def test_pairwise_preference_learns(workdir, example):
    store, record, stdout = run_example(workdir, example)
    accuracy = series(store, record.run_id, "eval/accuracy")
    margin = series(store, record.run_id, "eval/margin")
    assert len(accuracy) == 2  # before training and after the last step
    # Before training the policy is its reference: every margin is 0, every pair a tie.
    assert accuracy[0] == 0.5 and margin[0] == 0.0
    assert accuracy[-1] > 0.8, accuracy
    assert margin[-1] > 0.2, margin
    train_margin = series(store, record.run_id, "train/margin")
    assert mean(train_margin[-8:]) > mean(train_margin[:8]) + 0.2, train_margin
    # The progress line shows an offline run's loss and held-out accuracy.
    assert "eval acc" in stdout and "loss" in stdout
    entropy = series(store, record.run_id, "train/entropy")
    assert entropy and all(0 < e < 10 for e in entropy), entropy  # nats, vocabulary of 1000s

    plan = read_plan(Path(record.run_dir) / "plan.lock", check_fresh=False)
    cache = Path(record.run_dir) / "reference-logprobs.safetensors"
    with safe_open(str(cache), framework="pt") as handle:
        assert handle.metadata()["model_fingerprint"] == plan.model.fingerprint
        assert set(handle.keys()) == {
            "train.chosen",
            "train.rejected",
            "eval.chosen",
            "eval.rejected",
        }
        assert handle.get_tensor("train.chosen").shape == (256,)


def test_kto_learns_from_unpaired_labels(workdir):
    store, record, _ = run_example(workdir, "kto-tiny.toml")
    accuracy = series(store, record.run_id, "eval/accuracy")
    margin = series(store, record.run_id, "eval/margin")
    assert accuracy[0] == 0.5  # every implicit reward is 0 before training
    assert accuracy[-1] > 0.8, accuracy
    assert margin[-1] > margin[0] + 0.2, margin
    assert series(store, record.run_id, "train/kl")  # the reference point is recorded
    assert all(e > 0 for e in series(store, record.run_id, "train/entropy"))


@pytest.mark.parametrize("packing", [False, True])
def test_sft_held_out_loss_falls(workdir, packing):
    store, record, _ = run_example(
        workdir, "sft-tiny.toml", f"algorithm.packing={str(packing).lower()}"
    )
    loss = series(store, record.run_id, "eval/loss")
    assert len(loss) == 2
    assert loss[-1] < 0.5 * loss[0], loss
    train = series(store, record.run_id, "train/loss")
    assert mean(train[-5:]) < mean(train[:5]), train
    # Learning the targets makes the policy surer of them: its entropy there falls.
    entropy = series(store, record.run_id, "train/entropy")
    assert mean(entropy[-5:]) < mean(entropy[:5]), entropy


def test_reward_model_ranks_held_out_pairs(workdir):
    store, record, _ = run_example(workdir, "rm-tiny.toml")
    accuracy = series(store, record.run_id, "eval/accuracy")
    assert accuracy[-1] > 0.8, accuracy
    model_dir = Path(store.checkpoints(record.run_id)[-1].location) / "model"
    assert '"LlamaForSequenceClassification"' in (model_dir / "config.json").read_text()


def test_a_trained_reward_model_rewards_a_grpo_run(workdir):
    store, rm, _ = run_example(workdir, "rm-tiny.toml", "algorithm.max_steps=8")
    reward = f'rewards=[{{ model = "{rm.run_dir}/checkpoints/last" }}]'
    store, grpo, _ = run_example(
        workdir,
        "grpo-tiny.toml",
        reward,
        "data.fields.answer=null",  # a reward model reads no answer
        "algorithm.max_steps=2",
        "data.eval=null",
        "checkpoint.interval=100",
    )
    scores = series(store, grpo.run_id, "reward/reward_model")
    assert len(scores) == 2
    assert all(isinstance(s, float) for s in scores)


def test_killed_run_resumes_without_repeating_or_skipping_batches(workdir):
    plan = workdir / "plan.lock"
    planned = rollout(
        workdir,
        "plan",
        "--config",
        "examples/dpo-tiny.toml",
        "-o",
        str(plan),
        "--set",
        "algorithm.epochs=6",  # 192 steps: long enough to be killed mid-way
        "--set",
        "checkpoint.interval=4",
        "--set",
        "logging.level='debug'",
    )
    assert planned.returncode == 0, planned.stderr
    host = subprocess.Popen(
        [sys.executable, "-m", "rollout", "run", "--plan", str(plan)],
        cwd=workdir,
        env=environment(workdir),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for_checkpoint(workdir, step=8, process=host)
    _kill_everything_running(str(workdir))  # SIGKILL: no handler runs, as in a crash
    host.wait(timeout=30)

    resumed = rollout(workdir, "run", "--plan", str(plan))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    store = open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False)
    (record,) = store.list_runs()
    assert record.status == "finished" and record.last_step == 192
    used: dict[int, list[str]] = {}
    messages = [line.message for line in store.logs(record.run_id, level="debug", limit=10_000)]
    for message in messages:
        if message.startswith("step ") and " samples " in message:
            step, _, samples = message.removeprefix("step ").partition(" samples ")
            used[int(step)] = samples.split(",")  # a step redone after the kill logs twice
    assert sorted(used) == list(range(1, 193))
    every = [sample for step in sorted(used) for sample in used[step]]
    # Six epochs: each record once in each, none twice, none skipped.
    assert len(every) == len(set(every)) == 6 * 256
    assert {sample.split(":")[0] for sample in every} == {str(epoch) for epoch in range(6)}
    assert any("reference log-probs: reusing" in m for m in messages)


def _wait_for_checkpoint(workdir: Path, *, step: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert process.poll() is None, "the run ended before it could be killed"
        if list((workdir / "runs").glob(f"*/checkpoints/step-{step:06d}/manifest.json")):
            return
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint at step {step} within 240 s")


def _kill_everything_running(marker: str) -> None:
    """SIGKILL every process whose command line mentions ``marker`` (host, torchrun, workers)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                if marker in command:
                    os.kill(int(entry.name), signal.SIGKILL)


def test_two_rank_run_resumed_mid_way_ends_as_one_that_never_stopped(workdir):
    """With dropout on, each rank draws its masks from its own torch generator: a two-rank run
    resumed from step 2 matches an uninterrupted one only if every rank's generator is restored
    (the checkpoint's RNG files hold rank 0's; rank 1's travel in the trainer state)."""
    model = build_tiny("tiny-llama", workdir / "tiny-llama-dropout")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.3}))
    plan = workdir / "plan.lock"
    planned = rollout(
        workdir,
        "plan",
        "--config",
        "examples/dpo-tiny.toml",
        "-o",
        str(plan),
        "--set",
        f"model={{ path = '{model}' }}",
        "--set",
        "cluster.nproc_per_node=2",
        "--set",
        "algorithm.max_steps=4",
        "--set",
        "checkpoint.interval=2",
        "--set",
        "data.eval.limit=8",
    )
    assert planned.returncode == 0, planned.stdout + planned.stderr
    first = rollout(workdir, "run", "--plan", str(plan))
    assert first.returncode == 0, first.stdout + first.stderr
    (checkpoints,) = (workdir / "runs").glob("*/checkpoints")
    state = json.loads((checkpoints / "step-000002" / "trainer.json").read_text())
    assert set(state["trainer_state"]["rng"]) == {"1"}  # rank 0's are the checkpoint's own files
    final = checkpoints / "step-000004" / "model" / "model.safetensors"
    uninterrupted = load_file(final)

    # As if the run had stopped after step 2: its later checkpoint never existed, and the store
    # says stopped (a finished run is not started again).
    shutil.rmtree(checkpoints / "step-000004")
    with open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False) as store:
        (record,) = store.list_runs()
        store.set_status(record.run_id, "stopped")
    resumed = rollout(workdir, "run", "--plan", str(plan))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    weights = load_file(final)
    assert sorted(weights) == sorted(uninterrupted)
    differ = [name for name in weights if not torch.equal(weights[name], uninterrupted[name])]
    assert not differ, differ

    store = open_store(f"sqlite:{workdir / 'runs' / 'rollout.db'}", create=False)
    (record,) = store.list_runs()
    logs = [line.message for line in store.logs(record.run_id, limit=10_000)]
    assert any(m.startswith("resumed from") and "step 2" in m for m in logs), logs
    # Steps 3 and 4 were recorded twice, by each run: with the same numbers.
    recorded: dict[tuple[int, str], set[float]] = defaultdict(set)
    for metric in store.metrics(record.run_id):
        if metric.step > 2 and not metric.name.startswith("perf/"):
            recorded[metric.step, metric.name].add(metric.value)
    assert {"train/loss", "eval/accuracy"} <= {name for _, name in recorded}
    assert {key: values for key, values in recorded.items() if len(values) > 1} == {}
