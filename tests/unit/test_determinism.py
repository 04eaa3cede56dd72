"""make_deterministic: seeded global generators, and the backward that made runs drift repeats."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from rollout.runtime.determinism import make_deterministic


@pytest.fixture
def restored():
    """make_deterministic changes process-wide state: put it back for the tests that follow."""
    rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    mode = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    threads = torch.get_num_threads()
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    yield
    random.setstate(rng[0])
    np.random.set_state(rng[1])
    torch.set_rng_state(rng[2])
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.set_num_threads(threads)
    if cublas is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_seeds_every_global_generator(restored):
    make_deterministic(1267250544)
    first = _draws()
    make_deterministic(1267250544)
    assert _draws() == first
    make_deterministic(5)
    assert _draws() != first


def test_a_prompt_repeated_over_rows_gets_one_gradient(restored):
    """The learner's shared-prompt forward repeats a prompt's logits (and keys and values) over
    its completions' rows. Without deterministic kernels, two threads add those rows into one
    gradient in whatever order they arrive: on 2 cores about 160 backwards in 200 gave a
    gradient different from the others."""
    make_deterministic(0)
    torch.set_num_threads(2)
    logits = torch.randn(1, 1, 49152, requires_grad=True)
    upstream = torch.randn(4, 1, 49152)
    rows = torch.tensor([0, 0, 0, 0])
    gradients = set()
    for _ in range(50):
        logits.grad = None
        logits[rows].backward(upstream)
        gradients.add(logits.grad.numpy().tobytes())
    assert len(gradients) == 1
    assert torch.utils.deterministic.fill_uninitialized_memory is False
