"""Metrics across ranks: step metrics are averaged over ranks, evaluation metrics are means over
every rank's samples, however unevenly the ranks shared them. Two ranks are two threads here,
reduced through a stand-in for torch.distributed.all_reduce. And logging.interval: which training
steps are recorded."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from rollout.runtime import recording
from rollout.runtime.online.batches import Sample
from rollout.runtime.recording import record_means, record_metrics, record_samples, records_step


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

    def all_reduce(self, tensor: torch.Tensor, group: object = None) -> None:
        self.tensors[threading.get_ident()] = tensor.clone()
        self.barrier.wait()
        total = torch.stack(list(self.tensors.values())).sum(dim=0)
        self.barrier.wait()  # every rank has read every tensor before any is replaced
        tensor.copy_(total)

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor, group=None) -> None:
        """Every thread's tensor, in the order of the threads' idents (the same on each)."""
        self.tensors[threading.get_ident()] = tensor.clone()
        self.barrier.wait()
        for part, (_, value) in zip(parts, sorted(self.tensors.items()), strict=True):
            part.copy_(value)
        self.barrier.wait()


def plan(
    *,
    interval: int = 1,
    total: int = 10,
    checkpoint: int = 50,
    eval_interval: int | None = None,
    samples_per_step: int = 4,
) -> SimpleNamespace:
    """What recording reads of a plan."""
    config = SimpleNamespace(
        logging=SimpleNamespace(interval=interval, samples_per_step=samples_per_step),
        checkpoint=SimpleNamespace(interval=checkpoint),
        run=SimpleNamespace(eval_interval=eval_interval),
    )
    return SimpleNamespace(run_id="run", config=config, derived=SimpleNamespace(total_steps=total))


def context(rank: int, world: int, **plan_options) -> SimpleNamespace:
    return SimpleNamespace(
        rank=rank,
        world_size=world,
        is_main=rank == 0,
        learners=world,  # colocated: every rank learns
        plan=plan(**plan_options),
        stop=threading.Event(),
    )


def patch_collectives(monkeypatch, world: int) -> None:
    group = ThreadGroup(world)
    monkeypatch.setattr(recording.transport.dist, "all_reduce", group.all_reduce)
    monkeypatch.setattr(recording.transport.dist, "all_gather", group.all_gather)
    monkeypatch.setattr(recording.transport.dist, "get_world_size", lambda group=None: world)


def on_ranks(monkeypatch, calls) -> Writer:
    """Run calls[r](ctx of rank r, writer) on every rank at once; what rank 0 wrote."""
    patch_collectives(monkeypatch, len(calls))
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


def test_a_metric_some_ranks_lack_is_averaged_over_the_ranks_that_have_it(monkeypatch):
    # Rank 1 skipped every row (all advantages 0): it has a loss but no clip fraction. Before,
    # the two ranks summed vectors of different lengths, which aborted gloo's all_reduce.
    writer = on_ranks(
        monkeypatch,
        [
            lambda ctx, w: record_metrics(ctx, w, 6, {"train/loss": 1.0, "train/clip": 0.5}),
            lambda ctx, w: record_metrics(ctx, w, 6, {"train/loss": 3.0}),
        ],
    )
    assert writer.written == [(6, {"train/clip": 0.5, "train/loss": 2.0})]


def test_one_rank_needs_no_collective():
    writer = Writer()
    record_means(context(0, 1), writer, 2, {"eval/reward": 3.0}, 4)
    record_means(context(0, 1), writer, 3, {"eval/reward": 0.0}, 0)
    assert writer.written == [(2, {"eval/reward": 0.75}), (3, {"eval/reward": 0.0})]


@pytest.mark.parametrize("rows", [0, 3])
def test_evaluate_returns_sums_and_the_number_of_rows(rows):
    from rollout.harness.reward_contract import describe
    from rollout.harness.reward_runner import RewardRunner
    from rollout.runtime.online.actor import PromptFormat
    from rollout.runtime.online.evaluate import evaluate

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


# --- logging.interval


def test_interval_records_every_nth_step_and_the_steps_that_must_be_there():
    # interval 3 over 10 steps, checkpoints every 4, evaluation every 5: multiples of 3, then
    # 4 and 8 (checkpoints), 5 (evaluation) and 10 (the last step); 0 is the evaluation before.
    thinned = plan(interval=3, total=10, checkpoint=4, eval_interval=5)
    assert [s for s in range(11) if records_step(thinned, s)] == [0, 3, 4, 5, 6, 8, 9, 10]
    assert all(records_step(plan(), s) for s in range(11))  # the default records every step


def test_record_metrics_skips_the_steps_between_intervals():
    writer = Writer()
    ctx = context(0, 1, interval=4, total=10)
    for step in range(1, 11):
        record_metrics(ctx, writer, step, {"train/loss": float(step)})
    assert [step for step, _ in writer.written] == [4, 8, 10]
    record_means(ctx, writer, 7, {"eval/reward": 1.0}, 1)  # evaluation: always
    assert writer.written[-1] == (7, {"eval/reward": 1.0})


def test_a_step_a_stop_will_checkpoint_is_recorded():
    writer = Writer()
    ctx = context(0, 1, interval=4, total=10)
    ctx.stop.set()  # asked during step 5: the loop checkpoints step 5 next
    record_metrics(ctx, writer, 5, {"train/loss": 0.5})
    assert writer.written == [(5, {"train/loss": 0.5})]


def test_skipped_steps_still_reduce_on_every_rank(monkeypatch):
    # Rank 0 records step 3 (a stop is coming), rank 1 would not: both must enter the collective.
    def rank0(ctx, w):
        ctx.stop.set()
        record_metrics(ctx, w, 3, {"train/loss": 1.0})

    def rank1(ctx, w):
        record_metrics(ctx, w, 3, {"train/loss": 3.0})

    patch_collectives(monkeypatch, 2)
    writer = Writer()
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(call, context(rank, 2, interval=10), writer)
            for rank, call in enumerate((rank0, rank1))
        ]
        for future in futures:
            future.result()
    assert writer.written == [(3, {"train/loss": 2.0})]


def test_a_step_line_shows_what_the_step_has_in_a_fixed_order():
    from rollout.runtime.recording import step_line

    online = {"perf/step_s": 1.234, "reward/mean": 0.41234, "train/loss": 0.0123, "x": 1.0}
    assert step_line(3, 20, online) == "step 3/20: reward 0.4123, loss 0.0123, 1.23 s/step"
    assert step_line(1, 2, {"train/loss": 2.5, "train/accuracy": 0.5}) == (
        "step 1/2: loss 2.5, accuracy 0.5"
    )


class SampleWriter:
    def __init__(self):
        self.written = []

    def write_samples(self, samples):
        self.written += samples


def samples(count: int) -> list[Sample]:
    return [Sample(f"p{i}", f"c{i}", None, float(i), {"i": i}) for i in range(count)]


def test_the_first_samples_of_a_recorded_step_are_written_by_the_main_rank():
    writer = SampleWriter()
    record_samples(context(0, 2, samples_per_step=3), writer, 4, samples(8))
    assert [(s.step, s.index, s.completion, s.reward) for s in writer.written] == [
        (4, 0, "c0", 0.0),
        (4, 1, "c1", 1.0),
        (4, 2, "c2", 2.0),
    ]
    assert writer.written[0].run_id == "run" and writer.written[2].extra == {"i": 2}


@pytest.mark.parametrize(
    ("rank", "options", "step"),
    [
        (1, {}, 4),  # not the main rank
        (0, {"samples_per_step": 0}, 4),  # off
        (0, {"interval": 5}, 4),  # a step logging.interval leaves out
    ],
)
def test_samples_are_not_written(rank, options, step):
    writer = SampleWriter()
    record_samples(context(rank, 2, **options), writer, step, samples(8))
    assert writer.written == []
