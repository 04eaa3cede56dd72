"""Sample completions in the run store (migration 4), on SQLite and on Postgres alike: rows read
back as written (JSON turns and extras, NaN rewards), a redone step replaces its samples, steps
filter, the writer carries them, and a store at version 3 gains the table."""

from __future__ import annotations

import math
import sqlite3
import time

import pytest

from rollout.storage import open_store
from rollout.storage.base import SampleRecord
from rollout.storage.migrations import LATEST, MIGRATIONS
from rollout.storage.sqlite import SqliteRunStore
from rollout.storage.writer import BackgroundWriter


@pytest.fixture
def store(store_location):
    with open_store(store_location) as the_store:
        the_store.create_run(
            "r1", name="t", plan_sha256="ab" * 32, plan_path="/p/plan.lock", run_dir="/p"
        )
        yield the_store


def sample(step, index, *, reward=1.0, completion="42", turns=None, run_id="r1", extra=None):
    return SampleRecord(
        run_id=run_id,
        step=step,
        index=index,
        prompt=f"what is {step} + {index}?",
        completion=completion,
        turns=turns,
        reward=reward,
        extra=extra if extra is not None else {"reward/exact": reward},
        time=time.time(),
    )


def test_samples_read_back_as_written(store):
    turns = [
        {"role": "assistant", "content": "guess 5"},
        {"role": "user", "content": "higher — ünïcode"},
    ]
    written = [
        sample(1, 0),
        sample(1, 1, reward=math.nan, extra={"finish": "length", "nested": [1, 2]}),
        sample(2, 0, completion=None, turns=turns, reward=-0.5),
        sample(2, 1, completion="final", turns=[{**turns[0], "call": 1, "tokens": 3}]),
    ]
    store.add_samples(written)
    read = store.samples("r1")
    assert [(s.step, s.index) for s in read] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert read[0] == written[0]
    assert math.isnan(read[1].reward) and read[1].extra == {"finish": "length", "nested": [1, 2]}
    assert read[2].turns == turns and read[2].completion is None and read[2].reward == -0.5
    assert read[3] == written[3]  # an agent episode: its answer, and turns with numbers in them


def test_a_redone_step_replaces_its_samples(store):
    store.add_samples([sample(3, 0, completion="first")])
    store.add_samples([sample(3, 0, completion="second", reward=0.25)])
    (only,) = store.samples("r1")
    assert only.completion == "second" and only.reward == 0.25


def test_sample_steps_and_step_filter(store):
    store.add_samples([sample(step, i) for step in (1, 5, 9) for i in range(2)])
    assert store.sample_steps("r1") == [1, 5, 9]
    assert [(s.step, s.index) for s in store.samples("r1", [5, 9])] == [
        (5, 0),
        (5, 1),
        (9, 0),
        (9, 1),
    ]
    assert store.samples("r1", []) == []
    assert store.samples("other") == [] and store.sample_steps("other") == []


def test_samples_of_an_unknown_run_are_refused(store):
    with pytest.raises(Exception, match=r"(?i)foreign key|violates"):
        store.add_samples([sample(1, 0, run_id="ghost")])


def test_the_writer_writes_samples_off_the_caller(store_location, store):
    with BackgroundWriter(lambda: open_store(store_location), flush_interval_s=60) as writer:
        writer.write_samples([sample(1, 0), sample(1, 1)])
        writer.write_metrics("r1", 1, {"reward/mean": 1.0})
        writer.flush()
        assert [s.index for s in store.samples("r1")] == [0, 1]


def test_a_version_3_sqlite_store_gains_the_samples_table(tmp_path):
    path = tmp_path / "runs.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at REAL)")
    for migration in MIGRATIONS[:3]:
        conn.executescript(migration.sqlite)
        conn.execute("INSERT INTO schema_version VALUES (?, 0)", (migration.number,))
    conn.close()
    assert LATEST >= 4
    with SqliteRunStore(path) as migrated:
        migrated.create_run("r1", name="t", plan_sha256="ab" * 32, plan_path="/p", run_dir="/p")
        migrated.add_samples([sample(1, 0)])
        assert migrated.samples("r1")[0].completion == "42"


def test_metric_buckets_match_thinning_in_python(store):
    """The store's buckets (rollout report's long series) are rollout.reports.series.thin's."""
    from rollout.reports.series import thin
    from rollout.storage.base import MetricRecord

    values = {step: math.sin(step) * 10 for step in range(1, 200)}
    values[7], values[8] = math.nan, math.inf  # not values: left out of the bucket
    values.update({step: math.nan for step in range(40, 50)})  # a bucket of NaN only
    store.add_metrics(MetricRecord("r1", step, "m", v, 0.0) for step, v in values.items())
    assert store.metric_counts("r1") == {"m": 199}
    buckets = store.metric_buckets("r1", "m", width=10)
    expected = thin("m", sorted(values.items()), origin=0, width=10, max_points=1).points
    assert [b[0] for b in buckets] == [e[0] for e in expected] == list(range(0, 200, 10))
    assert buckets[4] == (40, None, None, None)
    for got, want in zip(buckets, expected, strict=True):
        assert got == pytest.approx(want), (got, want)


def test_nul_in_a_completion_or_a_log_line_is_stored_alike_on_both_backends(store):
    """A random model's completion can hold NUL, which Postgres text refuses (a run on Postgres
    failed on it): both stores keep it as U+FFFD, the rest of the text as written."""
    turns = [{"role": "assistant", "content": "a\x00b"}]
    store.add_samples(
        [sample(1, 0, completion="x\x00y"), sample(1, 1, completion=None, turns=turns)]
    )
    first, second = store.samples("r1")
    assert first.completion == "x\ufffdy" and second.turns == turns  # JSON escapes NUL itself
    store.add_logs([("r1", time.time(), "info", 0, "actor", "said \x00 this")])
    (line,) = store.logs("r1")
    assert line.message == "said \ufffd this"
