"""CompletionRecorder: per-episode order, draining, its bound, and many threads at once."""

from __future__ import annotations

import threading

import pytest

from rollout.engines.base import Completion
from rollout.serve.recording import CompletionRecorder, RecorderFull


def completion(token: int, version: int = 0) -> Completion:
    return Completion(
        prompt_index=0,
        token_ids=[token, token + 1],
        logprobs=[-0.5, -1.5],
        text="",
        finish_reason="length",
        policy_version=version,
    )


def test_drain_gives_an_episodes_completions_in_order_and_removes_them():
    recorder = CompletionRecorder()
    recorder.record("a", "chat", [1, 2], completion(10, version=3))
    recorder.record("b", "completion", [5], completion(20))
    recorder.record("a", "completion", [3], completion(30))
    assert recorder.episodes() == ["a", "b"] and len(recorder) == 3
    drained = recorder.drain("a")
    assert [(r.kind, r.prompt_token_ids, r.token_ids) for r in drained] == [
        ("chat", [1, 2], [10, 11]),
        ("completion", [3], [30, 31]),
    ]
    assert drained[0].policy_version == 3 and drained[0].logprobs == [-0.5, -1.5]
    assert recorder.drain("a") == [] and recorder.episodes() == ["b"] and len(recorder) == 1


def test_the_bound_refuses_until_drained():
    recorder = CompletionRecorder(max_completions=2)
    recorder.check_room()
    recorder.record("a", "chat", [1], completion(1))
    recorder.record("a", "chat", [1], completion(2))
    with pytest.raises(RecorderFull, match="drain"):
        recorder.check_room()
    recorder.drain("a")
    recorder.check_room()
    with pytest.raises(ValueError):
        CompletionRecorder(max_completions=0)


def test_many_threads_record_at_once_and_nothing_is_lost():
    recorder = CompletionRecorder()
    barrier = threading.Barrier(8)

    def record(worker: int) -> None:
        barrier.wait()
        for index in range(500):
            recorder.record(f"episode-{worker % 4}", "chat", [worker], completion(index))

    threads = [threading.Thread(target=record, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(recorder) == 4000
    drained = [recorder.drain(f"episode-{e}") for e in range(4)]
    assert [len(d) for d in drained] == [1000] * 4 and len(recorder) == 0
    # each worker's records keep their order within the episode
    mine = [r.token_ids[0] for r in drained[0] if r.prompt_token_ids == [0]]
    assert mine == list(range(500))
