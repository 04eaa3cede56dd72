"""tests/gpu: every test here is marked `gpu` and skipped, with the reason, where torch sees no
CUDA GPU. The integration fixtures are reused: a working directory holding a copy of examples/,
and no `rollout` process left running after a test."""

from __future__ import annotations

import pytest
import torch

from tests.integration.conftest import no_run_left_behind, workdir  # noqa: F401 (fixtures)

HERE = __file__.rsplit("/", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = None
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if str(item.path).startswith(HERE):
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
