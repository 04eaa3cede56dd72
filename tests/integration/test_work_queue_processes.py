"""Actor processes share a step's prompts through a TCPStore on 127.0.0.1, as torchrun's ranks
would: every item exactly once and in item order at the collector, a fast actor takes more
chunks than a slow one, and an actor killed (or stopped) while holding a chunk costs a lease,
not an item."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from rollout.runtime.work_queue import WorkQueue

STEP, ITEMS, CHUNK, LEASE_S = 3, 100, 4, 1.0
FAST_S, SLOW_S = 0.002, 0.05  # seconds per item


def _queue(store, lease_s: float = LEASE_S) -> WorkQueue:
    return WorkQueue(store, STEP, ITEMS, CHUNK, lease_s=lease_s, poll_s=0.02)


def _actor(
    port: int, name: str, per_item_s: float, actors: int, role: str, report: str, lease_s: float
) -> None:
    """One actor process. `role`: "work" claims until the step is done; "die" claims one chunk,
    says which, and sleeps until killed; "stall" claims one, says which, and completes it when
    the test says so (after having been stopped long enough to lose its lease)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    store.add("test/ready", 1)
    while store.add("test/ready", 0) < actors:  # start together: imports take unequal times
        time.sleep(0.01)
    outcome: dict = {"processed": []}
    with _queue(store, lease_s).actor(name) as actor:
        if role != "work":
            held = actor.claim()
            store.set(f"test/held/{name}", str(held.index))
            if role == "die":
                time.sleep(600)
            store.get("test/resume")  # blocks; the test stops this process meanwhile
            outcome["late_counted"] = actor.complete(
                held, [{"item": i, "by": name} for i in held.items]
            )
        while (chunk := actor.claim()) is not None:
            results = []
            for item in chunk.items:
                time.sleep(per_item_s)  # generating
                results.append({"item": item, "by": name})
            outcome["processed"].extend(chunk.items)
            actor.complete(chunk, results)
    outcome["metrics"] = actor.metrics.as_dict()
    Path(report).write_text(json.dumps(outcome))


class _Actors:
    """The actor processes of one test, on a TCPStore this process serves; none outlives it."""

    def __init__(
        self, tmp_path: Path, specs: list[tuple[str, float, str]], lease_s: float = LEASE_S
    ) -> None:
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.tmp_path = tmp_path
        # Fresh interpreters, as torchrun's, forked from a server that imported torch once:
        # three interpreters importing torch at once take 10 s on a busy 2-core machine.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])
        self.processes = {
            name: context.Process(
                target=_actor,
                args=(
                    self.store.port,
                    name,
                    per_item,
                    len(specs),
                    role,
                    str(tmp_path / name),
                    lease_s,
                ),
            )
            for name, per_item, role in specs
        }

    def __enter__(self) -> _Actors:
        for process in self.processes.values():
            process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes.values():
            if process.is_alive():
                os.kill(process.pid, signal.SIGCONT)  # a stopped process cannot die of SIGKILL
                process.kill()
            process.join(timeout=30)

    def held_by(self, name: str, timeout_s: float = 60) -> int:
        self.store.wait([f"test/held/{name}"], timedelta(seconds=timeout_s))
        return int(self.store.get(f"test/held/{name}"))

    def finish(self, *names: str) -> dict[str, dict]:
        for name in names:
            self.processes[name].join(timeout=60)
            assert self.processes[name].exitcode == 0, name
        return {name: json.loads((self.tmp_path / name).read_text()) for name in names}


def _by_chunk(results: list[dict]) -> list[str]:
    """Who completed each chunk, from the collected results (one name per chunk)."""
    owners = [{r["by"] for r in results[i : i + CHUNK]} for i in range(0, ITEMS, CHUNK)]
    assert all(len(owner) == 1 for owner in owners)
    return [owner.pop() for owner in owners]


def test_three_processes_share_the_items_once_each_and_the_fast_take_more(tmp_path) -> None:
    specs = [("fast-0", FAST_S, "work"), ("fast-1", FAST_S, "work"), ("slow", SLOW_S, "work")]
    # Nobody dies here: a long lease keeps a heartbeat thread starved on a busy machine from
    # passing for a death (that would redo a chunk, which is the other tests' subject).
    with _Actors(tmp_path, specs, lease_s=10.0) as actors:
        results = _queue(actors.store, lease_s=10.0).collect(timeout_s=60)
        reports = actors.finish("fast-0", "fast-1", "slow")
        remaining_keys = actors.store.num_keys()
    assert [r["item"] for r in results] == list(range(ITEMS))
    processed = sorted(i for report in reports.values() for i in report["processed"])
    assert processed == list(range(ITEMS))  # nobody did any item twice: no lease expired
    claimed = {name: report["metrics"]["queue/chunks_claimed"] for name, report in reports.items()}
    print(f"\nchunks claimed: {claimed}")
    assert sum(claimed.values()) == ITEMS // CHUNK
    assert claimed["slow"] < min(claimed["fast-0"], claimed["fast-1"])
    assert all(report["metrics"]["queue/chunks_requeued"] == 0 for report in reports.values())
    assert remaining_keys == 2  # the test's "ready" counter and the consumed mark: the step is gone


def test_a_chunk_of_an_actor_killed_mid_chunk_is_redone_by_another(tmp_path) -> None:
    specs = [("victim", FAST_S, "die"), ("a", FAST_S, "work"), ("b", FAST_S, "work")]
    with _Actors(tmp_path, specs) as actors:
        queue = _queue(actors.store)
        lost = actors.held_by("victim")
        time.sleep(2 * LEASE_S)  # alive and beating: nobody takes its chunk
        assert [(c.index, c.actor, c.attempt) for c in queue.pending()] == [(lost, "victim", 0)]
        actors.processes["victim"].kill()  # SIGKILL: no cleanup, the heartbeat stops
        started = time.monotonic()
        results = queue.collect(timeout_s=60)
        recovered_s = time.monotonic() - started
        reports = actors.finish("a", "b")
    print(f"\nchunk {lost} recovered {recovered_s:.2f} s after the kill (lease {LEASE_S} s)")
    assert [r["item"] for r in results] == list(range(ITEMS))
    assert _by_chunk(results)[lost] in ("a", "b")
    # The lease runs from the last heartbeat the watchers saw, up to one interval before the kill.
    assert 0.75 * LEASE_S - 0.05 <= recovered_s < LEASE_S + 5
    requeued = [report["metrics"]["queue/chunks_requeued"] for report in reports.values()]
    assert sorted(requeued) == [0, 1]
    processed = sorted(i for report in reports.values() for i in report["processed"])
    assert processed == list(range(ITEMS))  # the survivors did every item once between them


def test_a_late_completion_of_a_requeued_chunk_is_ignored(tmp_path) -> None:
    specs = [("stalled", FAST_S, "stall"), ("a", FAST_S, "work"), ("b", FAST_S, "work")]
    with _Actors(tmp_path, specs) as actors:
        queue = _queue(actors.store)
        lost = actors.held_by("stalled")
        os.kill(actors.processes["stalled"].pid, signal.SIGSTOP)  # paused, not dead
        done = queue.collect(timeout_s=60, release=False)  # another actor redid its chunk
        actors.store.set("test/resume", "1")
        os.kill(actors.processes["stalled"].pid, signal.SIGCONT)
        reports = actors.finish("stalled", "a", "b")
        results = queue.collect(timeout_s=1)
    assert reports["stalled"]["late_counted"] is False
    assert reports["stalled"]["metrics"]["queue/completions_ignored"] == 1
    assert results == done and [r["item"] for r in results] == list(range(ITEMS))
    assert _by_chunk(results)[lost] in ("a", "b")
