"""load_records over JSONL, Parquet and fsspec; PromptStream's order, sharding and resume."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import fsspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.runtime.data import PromptStream, load_records

RECORDS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(10)]


def jsonl_text(records: list[dict]) -> str:
    return "".join(json.dumps(record) + "\n" for record in records)


def indices(rows) -> list[int]:
    return [row.index for row in rows]


# --- load_records --------------------------------------------------------------------------------


def test_jsonl_skips_blank_lines_and_keeps_file_order(tmp_path: Path):
    path = tmp_path / "train.jsonl"
    path.write_text(jsonl_text(RECORDS[:3]) + "\n  \n" + jsonl_text(RECORDS[3:]))
    assert load_records(str(path), "jsonl", None) == RECORDS


def test_limit_keeps_the_first_records(tmp_path: Path):
    path = tmp_path / "train.jsonl"
    path.write_text(jsonl_text(RECORDS))
    assert load_records(str(path), "jsonl", 4) == RECORDS[:4]
    assert load_records(str(path), "jsonl", 100) == RECORDS


def test_parquet(tmp_path: Path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), path, row_group_size=3)
    assert load_records(str(path), "parquet", None) == RECORDS
    assert load_records(f"file://{path}", "parquet", 5) == RECORDS[:5]


def test_fsspec_memory_url():
    with fsspec.open("memory://rollout-test/train.jsonl", "w") as handle:
        handle.write(jsonl_text(RECORDS))
    assert load_records("memory://rollout-test/train.jsonl", "jsonl", 2) == RECORDS[:2]


def test_a_record_that_is_not_an_object_is_an_error(tmp_path: Path):
    path = tmp_path / "train.jsonl"
    path.write_text(jsonl_text(RECORDS[:2]) + "[1, 2]\n")
    with pytest.raises(ValueError, match=r"line 3 .* not a JSON object"):
        load_records(str(path), "jsonl", None)


# --- PromptStream --------------------------------------------------------------------------------


def test_same_seed_same_order_other_seed_other_order():
    def first_epoch(seed: int) -> list[int]:
        return indices(PromptStream(RECORDS, seed=seed, shuffle=True).take(len(RECORDS)))

    assert first_epoch(7) == first_epoch(7)
    assert first_epoch(7) != first_epoch(8)
    assert sorted(first_epoch(7)) == list(range(len(RECORDS)))


def test_epochs_differ_in_order_and_rows_carry_their_epoch():
    records = [{"prompt": str(i)} for i in range(50)]
    rows = PromptStream(records, seed=3, shuffle=True).take(100)
    epoch0, epoch1 = rows[:50], rows[50:]
    assert {row.epoch for row in epoch0} == {0} and {row.epoch for row in epoch1} == {1}
    assert sorted(indices(epoch0)) == sorted(indices(epoch1)) == list(range(50))
    assert indices(epoch0) != indices(epoch1)
    assert all(row.record is records[row.index] for row in rows)


def test_without_shuffle_every_epoch_is_file_order():
    rows = PromptStream(RECORDS, seed=3, shuffle=False).take(25)
    assert indices(rows) == [*range(10), *range(10), *range(5)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 13])
def test_ranks_together_cover_every_epoch_exactly_once(world_size: int):
    streams = [
        PromptStream(RECORDS, seed=5, shuffle=True, rank=rank, world_size=world_size)
        for rank in range(world_size)
    ]
    taken = [row for _ in range(7) for stream in streams for row in stream.take(2)]
    per_epoch: dict[int, Counter] = {}
    for row in taken:
        per_epoch.setdefault(row.epoch, Counter())[row.index] += 1
    *whole, last = sorted(per_epoch)
    for epoch in whole:
        assert per_epoch[epoch] == Counter(range(len(RECORDS))), epoch
    assert max(per_epoch[last].values()) == 1
    # Every rank holds the same cursor, so any one of them can be saved for all.
    assert len({json.dumps(stream.state_dict()) for stream in streams}) == 1


def test_rank_r_takes_every_world_size_th_item_of_the_order():
    whole = indices(PromptStream(RECORDS, seed=9, shuffle=True).take(len(RECORDS)))
    for rank in range(3):
        stream = PromptStream(RECORDS, seed=9, shuffle=True, rank=rank, world_size=3)
        assert indices(stream.take(len(whole[rank::3]))) == whole[rank::3]


def test_iterating_yields_the_same_rows_as_take():
    stream = PromptStream(RECORDS, seed=1, shuffle=True)
    iterator = iter(stream)
    first = [next(iterator) for _ in range(13)]
    assert first == PromptStream(RECORDS, seed=1, shuffle=True).take(13)
    assert stream.state_dict()["epoch"] == 1 and stream.state_dict()["position"] == 3


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=12), min_size=1, max_size=8),
    cut=st.integers(min_value=0, max_value=8),
    world_size=st.integers(min_value=1, max_value=3),
)
def test_resume_mid_epoch_equals_an_uninterrupted_run(sizes, cut, world_size):
    def stream(rank: int) -> PromptStream:
        return PromptStream(RECORDS, seed=11, shuffle=True, rank=rank, world_size=world_size)

    for rank in range(world_size):
        uninterrupted = stream(rank)
        expected = [uninterrupted.take(n) for n in sizes]

        before = stream(rank)
        got = [before.take(n) for n in sizes[:cut]]
        saved = json.loads(json.dumps(before.state_dict()))  # it travels as JSON
        after = stream(rank)
        after.load_state_dict(saved)
        got += [after.take(n) for n in sizes[cut:]]

        assert got == expected
        assert after.state_dict() == uninterrupted.state_dict()


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"seed": 12}, "seed"),
        ({"records": RECORDS[:9]}, "num_records"),
        ({"world_size": 2}, "world_size"),
        ({"shuffle": False}, "shuffle"),
    ],
)
def test_a_cursor_from_another_setup_is_refused(change: dict, key: str):
    saved = PromptStream(RECORDS, seed=11, shuffle=True)
    saved.take(4)
    options = {"records": RECORDS, "seed": 11, "shuffle": True, "world_size": 1, **change}
    resumed = PromptStream(options.pop("records"), **options)
    with pytest.raises(ValueError, match=f"saved with {key}="):
        resumed.load_state_dict(saved.state_dict())


def test_a_cursor_outside_the_dataset_is_refused():
    stream = PromptStream(RECORDS, seed=0, shuffle=True)
    with pytest.raises(ValueError, match="outside a dataset of 10 records"):
        stream.load_state_dict({**stream.state_dict(), "position": 10})


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one record"):
        PromptStream([], seed=0, shuffle=True)
    with pytest.raises(ValueError, match="rank 2 is outside a world of size 2"):
        PromptStream(RECORDS, seed=0, shuffle=True, rank=2, world_size=2)
