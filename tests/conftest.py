"""Shared fixtures: a valid base config, and a writer that puts configs (and data) on disk."""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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


HUB_ID = "rollout-tests/tiny-llama"
"""The Hub id the hub_cache fixture holds (tiny-llama's weights under another name)."""
COMMITS = ("a" * 40, "b" * 40)


@dataclass(frozen=True)
class HubCache:
    """A Hugging Face hub cache laid out as huggingface_hub writes it: models--org--name/ holding
    blobs/ (files named by content hash), snapshots/<commit>/ (links into blobs) and refs/."""

    root: Path
    source: Path  # the model directory every snapshot holds

    def add(
        self, repo_id: str = HUB_ID, commit: str = COMMITS[0], ref: str | None = "main"
    ) -> Path:
        from rollout.fingerprints import sha256_file

        repo = self.root / f"models--{repo_id.replace('/', '--')}"
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "blobs").mkdir(exist_ok=True)
        for file in sorted(p for p in self.source.iterdir() if p.is_file()):
            blob = repo / "blobs" / sha256_file(file)
            if not blob.exists():
                shutil.copyfile(file, blob)
            link = snapshot / file.name
            if not link.is_symlink():
                link.symlink_to(os.path.relpath(blob, snapshot))
        if ref is not None:
            self.point(ref, commit, repo_id)
        return snapshot

    def point(self, ref: str, commit: str, repo_id: str = HUB_ID) -> None:
        refs = self.root / f"models--{repo_id.replace('/', '--')}" / "refs"
        refs.mkdir(parents=True, exist_ok=True)
        (refs / ref).write_text(commit)  # huggingface_hub writes the sha with no newline


@pytest.fixture
def hub_cache(tmp_path: Path, rollout_cache: Path, monkeypatch: pytest.MonkeyPatch) -> HubCache:
    """An empty hub cache that HF_HUB_CACHE points at; `add` puts tiny-llama in it."""
    from rollout.models.builtin_build import builtin_model_dir

    root = tmp_path / "hf-hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return HubCache(root, builtin_model_dir("tiny-llama"))


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
