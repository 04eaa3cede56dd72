"""The committed files under examples/data/ are exactly what rollout.testing.datasets writes."""

from __future__ import annotations

from rollout.testing.datasets import example_files, to_jsonl
from tests.conftest import EXAMPLES


def test_committed_example_data_matches_its_generator():
    for name, records in example_files():
        committed = (EXAMPLES / "data" / name).read_text(encoding="utf-8")
        assert committed == to_jsonl(records), (
            f"examples/data/{name} differs from its generator: run "
            "`python -m rollout.testing.datasets examples/data`"
        )
