"""The reference log-prob cache: computed once, reused under the same key, never under another."""

from __future__ import annotations

import torch
from safetensors import safe_open

from rollout.runtime.offline.reference_cache import cached_reference

KEY = {"format_version": "1", "model_fingerprint": "aaa", "data_fingerprints": "train:1"}
SPLITS = {"train": 5, "eval": 2}
STREAMS = ("chosen", "rejected")


class Recorder:
    """A reference that scores record i as -(i + 1) when chosen and -10 (i + 1) when rejected."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []

    def __call__(self, split: str, indices: list[int]) -> dict[str, list[float]]:
        self.calls.append((split, indices))
        return {
            "chosen": [-(i + 1.0) for i in indices],
            "rejected": [-10.0 * (i + 1) for i in indices],
        }


def test_computed_in_chunks_then_reused(tmp_path):
    path = tmp_path / "run" / "reference-logprobs.safetensors"
    first = Recorder()
    tables = cached_reference(path, KEY, SPLITS, STREAMS, first, chunk_size=2)
    assert first.calls == [("train", [0, 1]), ("train", [2, 3]), ("train", [4]), ("eval", [0, 1])]
    assert sorted(tables) == ["eval.chosen", "eval.rejected", "train.chosen", "train.rejected"]
    torch.testing.assert_close(tables["train.rejected"], torch.tensor([-10.0, -20, -30, -40, -50]))
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == KEY

    again = Recorder()
    reused = cached_reference(path, KEY, SPLITS, STREAMS, again, chunk_size=2)
    assert again.calls == []
    for name, table in tables.items():
        torch.testing.assert_close(reused[name], table)


def test_another_model_never_reuses_the_file(tmp_path, caplog):
    path = tmp_path / "reference-logprobs.safetensors"
    cached_reference(path, KEY, SPLITS, STREAMS, Recorder(), chunk_size=8)
    other = Recorder()
    caplog.set_level("WARNING", logger="rollout.reference")
    cached_reference(
        path, {**KEY, "model_fingerprint": "bbb"}, SPLITS, STREAMS, other, chunk_size=8
    )
    assert other.calls == [("train", [0, 1, 2, 3, 4]), ("eval", [0, 1])]  # computed again
    assert "different model_fingerprint" in caplog.text
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata()["model_fingerprint"] == "bbb"


def test_a_file_with_other_record_counts_is_recomputed(tmp_path):
    path = tmp_path / "reference-logprobs.safetensors"
    cached_reference(path, KEY, {"train": 3}, STREAMS, Recorder(), chunk_size=8)
    again = Recorder()
    tables = cached_reference(path, KEY, {"train": 4}, STREAMS, again, chunk_size=8)
    assert again.calls == [("train", [0, 1, 2, 3])]
    assert tables["train.chosen"].shape == (4,)
