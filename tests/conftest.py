"""Shared fixtures: a valid base config, and a writer that puts configs (and data) on disk."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Nothing is downloaded: set before anything imports huggingface_hub.
os.environ["HF_HUB_OFFLINE"] = "1"

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"

BASE_CONFIG: dict[str, Any] = {
    "run": {"name": "t", "seed": 1},
    "model": {"builtin": "tiny-llama"},
    "data": {
        "train": {"path": "train.jsonl"},
        "fields": {"prompt": "prompt", "answer": "answer"},
    },
    "algorithm": {"kind": "grpo", "rollout_batch_size": 8, "num_generations": 4, "max_steps": 2},
    "generation": {"max_new_tokens": 8, "max_prompt_tokens": 32},
    "rewards": [{"fn": "numeric_match"}],
    "cluster": {"device": "cpu"},
}

TRAIN_RECORDS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(16)]


@pytest.fixture(scope="session")
def rollout_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """ROLLOUT_CACHE pointed at a session directory, so builtin models never land in ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("rollout-cache")
        patch.setenv("ROLLOUT_CACHE", str(path))
        yield path


@pytest.fixture
def base_config() -> dict[str, Any]:
    return copy.deepcopy(BASE_CONFIG)


def write_toml(path: Path, data: dict[str, Any]) -> Path:
    import tomli_w

    path.write_bytes(tomli_w.dumps(data).encode())
    return path


@pytest.fixture
def config_file(tmp_path: Path) -> Callable[..., Path]:
    """Write a config (dict -> TOML, or raw text) plus train.jsonl next to it; return its path."""

    def write(data: dict[str, Any] | str, name: str = "run.toml") -> Path:
        (tmp_path / "train.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in TRAIN_RECORDS), encoding="utf-8"
        )
        path = tmp_path / name
        if isinstance(data, str):
            path.write_text(data, encoding="utf-8")
        elif name.endswith(".json"):
            path.write_text(json.dumps(data), encoding="utf-8")
        elif name.endswith((".yaml", ".yml")):
            import yaml

            path.write_text(yaml.safe_dump(data), encoding="utf-8")
        else:
            write_toml(path, data)
        return path

    return write
