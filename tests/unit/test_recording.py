"""Metrics across ranks: step metrics are averaged over ranks, evaluation metrics are means over
every rank's samples, however unevenly the ranks shared them. Two ranks are two threads here,
reduced through a stand-in for torch.distributed.all_reduce."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from rollout.runtime import recording
from rollout.runtime.recording import record_means, record_metrics


class Writer:
    def __init__(self):
        self.written: list[tuple[int, dict[str, float]]] = []

    def write_metrics(self, run_id: str, step: int, values: dict[str, float]) -> None:
        self.written.append((step, values))


class ThreadGroup:
    """all_reduce (sum, in place) across `world` threads."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world, timeout=10)
        self.tensors: dict[int, torch.Tensor] = {}

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.tensors[threading.get_ident()] = tensor.clone()
        self.barrier.wait()
        total = torch.stack(list(self.tensors.values())).sum(dim=0)
        self.barrier.wait()  # every rank has read every tensor before any is replaced
        tensor.copy_(total)


def context(rank: int, world: int) -> SimpleNamespace:
    return SimpleNamespace(
        rank=rank, world_size=world, is_main=rank == 0, plan=SimpleNamespace(run_id="run")
    )


def on_ranks(monkeypatch, calls) -> Writer:
    """Run calls[r](ctx of rank r, writer) on every rank at once; what rank 0 wrote."""
    monkeypatch.setattr(recording.dist, "all_reduce", ThreadGroup(len(calls)).all_reduce)
    writer = Writer()
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [
            pool.submit(call, context(r, len(calls)), writer) for r, call in enumerate(calls)
        ]
        for future in futures:
            future.result()
    return writer


def test_eval_means_weigh_each_rank_by_its_samples(monkeypatch):
    # Rank 0 scored 3 prompts (rewards 1, 1, 0), rank 1 one prompt (reward 0): 2 of 4 is 0.5,
    # where a mean of the ranks' means would say (2/3 + 0) / 2 = 1/3.
    writer = on_ranks(
        monkeypatch,
        [
            lambda ctx, w: record_means(ctx, w, 5, {"eval/reward": 2.0, "eval/exact": 1.0}, 3),
            lambda ctx, w: record_means(ctx, w, 5, {"eval/reward": 0.0, "eval/exact": 1.0}, 1),
        ],
    )
    assert writer.written == [(5, {"eval/exact": 0.5, "eval/reward": 0.5})]


def test_a_rank_without_eval_samples_does_not_count(monkeypatch):
    writer = on_ranks(
        monkeypatch,
        [
            lambda ctx, w: record_means(ctx, w, 0, {"eval/reward": 1.5}, 2),
            lambda ctx, w: record_means(ctx, w, 0, {"eval/reward": 0.0}, 0),
        ],
    )
    assert writer.written == [(0, {"eval/reward": 0.75})]


def test_step_metrics_are_averaged_over_ranks(monkeypatch):
    writer = on_ranks(
        monkeypatch,
        [
            lambda ctx, w: record_metrics(ctx, w, 1, {"train/loss": 1.0}),
            lambda ctx, w: record_metrics(ctx, w, 1, {"train/loss": 3.0}),
        ],
    )
    assert writer.written == [(1, {"train/loss": 2.0})]


def test_one_rank_needs_no_collective():
    writer = Writer()
    record_means(context(0, 1), writer, 2, {"eval/reward": 3.0}, 4)
    record_means(context(0, 1), writer, 3, {"eval/reward": 0.0}, 0)
    assert writer.written == [(2, {"eval/reward": 0.75}), (3, {"eval/reward": 0.0})]


@pytest.mark.parametrize("rows", [0, 3])
def test_evaluate_returns_sums_and_the_number_of_rows(rows):
    from rollout.harness.reward_runner import RewardRunner, describe
    from rollout.runtime.actor import PromptFormat
    from rollout.runtime.evaluate import evaluate

    class Engine:
        def generate(self, prompts, params):
            assert params.temperature == 0.0 and params.n == 1
            return [SimpleNamespace(text=str(len(p))) for p in prompts]

    def length(prompts, completions, **_):
        return [float(c) for c in completions]

    prompt_format = PromptFormat(
        encode=lambda text: list(range(len(text))), prompt_field="prompt", role_fields={}
    )
    runner = RewardRunner([describe("length", length, 0.5, {}, 10.0)])
    generation = SimpleNamespace(max_new_tokens=4, stop=[])
    records = [{"prompt": "a" * n} for n in (1, 2, 3)][:rows]
    sums, count = evaluate(Engine(), prompt_format, runner, records, generation)
    # Each completion is its prompt's length: the sums of 1, 2, 3 (and weighted by 0.5).
    total = float(sum(range(1, rows + 1)))
    assert (sums, count) == ({"eval/length": total, "eval/reward": 0.5 * total}, rows)
