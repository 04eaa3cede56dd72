"""A trained reward model as a reward source: found and frozen at plan time, scoring in the worker."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from rollout.config.validate import validate_config
from rollout.errors import ConfigError, LockfileError, PlanError
from rollout.harness.model_reward import SAMPLE_FORMAT_KEY, ModelReward, reward_scores
from rollout.models.batches import pad_completions
from rollout.models.samples import HfTextTokenizer
from rollout.planner.builder import build_plan
from rollout.planner.lockfile import read_plan, write_plan
from rollout.planner.reward_model import resolve_reward_model
from rollout.runtime.components import build_reward_functions
from rollout.runtime.manifest import MANIFEST, build_manifest, manifest_bytes
from rollout.runtime.offline.objectives import build_reward_model


@pytest.fixture(scope="module")
def saved_run(tiny_llama, tmp_path_factory) -> Path:
    """A reward-model run directory with two checkpoints, step 2 complete and step 3 not."""
    torch.manual_seed(0)
    model = build_reward_model(copy.deepcopy(tiny_llama.model), tiny_llama.pad_token_id)
    setattr(
        model.config,
        SAMPLE_FORMAT_KEY,
        {"use_chat_template": True, "system_prompt": None, "eos_token_id": 2},
    )
    run = tmp_path_factory.mktemp("rm-run")
    for step, complete in ((2, True), (3, False)):
        directory = run / "checkpoints" / f"step-{step:06d}" / "model"
        model.save_pretrained(directory)
        tiny_llama.tokenizer.save_pretrained(directory)
        if complete:  # committed: its manifest written last, as a run's save does
            manifest = build_manifest(directory.parent, step=step, run_id="rm", plan="")
            (directory.parent / MANIFEST).write_bytes(manifest_bytes(manifest))
    return run


@pytest.mark.parametrize(
    "written",
    [
        "checkpoints/last",
        "checkpoints",
        ".",
        "checkpoints/step-000002",
        "checkpoints/step-000002/model",
    ],
)
def test_every_way_of_naming_the_model_finds_the_latest_complete_checkpoint(saved_run, written):
    identity = resolve_reward_model(written, base_dir=saved_run, used_by="rewards[0].model")
    assert identity.path == str(saved_run / "checkpoints/step-000002/model/model.safetensors")
    assert identity.sha256 and identity.used_by == "rewards[0].model"


def test_a_causal_lm_is_not_a_reward_model(tiny_llama, tmp_path):
    tiny_llama.model.save_pretrained(tmp_path / "lm")
    with pytest.raises(PlanError) as raised:
        resolve_reward_model("lm", base_dir=tmp_path, used_by="rewards[0].model")
    (issue,) = raised.value.issues
    assert "LlamaForCausalLM" in issue.message and "not a reward model" in issue.message
    assert 'kind = "rm"' in issue.hint


def test_a_run_without_complete_checkpoints(tmp_path):
    (tmp_path / "checkpoints" / "step-000001").mkdir(parents=True)
    with pytest.raises(PlanError, match="holds no complete checkpoint"):
        resolve_reward_model("checkpoints/last", base_dir=tmp_path, used_by="rewards[0].model")


def test_scores_match_the_head_on_the_last_token_in_any_batch_size(saved_run, tiny_llama):
    directory = saved_run / "checkpoints/step-000002/model"
    prompts = ["What is 1 + 1?", "What is 20 + 22?", "Say hi."]
    completions = ["2", "2022", "hi"]
    scorer = ModelReward(directory, batch_size=2)
    scores = scorer(prompts, completions, answer=["2", "42", "hi"])
    alone = [
        ModelReward(directory, batch_size=1)([p], [c])[0]
        for p, c in zip(prompts, completions, strict=True)
    ]
    assert scores == pytest.approx(alone, abs=1e-5)

    tokenizer = HfTextTokenizer.of(tiny_llama)
    prompt = tokenizer.chat([{"role": "user", "content": prompts[1]}], add_generation_prompt=True)
    completion = [*tokenizer.encode("2022", add_special_tokens=False), tokenizer.eos_token_id]
    batch = pad_completions([prompt], [completion], tiny_llama.pad_token_id, "cpu")
    with torch.no_grad():
        expected = reward_scores(
            scorer.model, batch.input_ids, batch.attention_mask, batch.position_ids
        )
    assert scores[1] == pytest.approx(float(expected), abs=1e-5)
    assert len(set(scores)) == 3  # the head is not constant


def grpo_config(tmp_path: Path, rewards: list[dict]) -> dict:
    (tmp_path / "train.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n' * 8)
    return {
        "run": {"name": "g", "output_dir": str(tmp_path / "runs")},
        "model": {"builtin": "tiny-llama"},
        "data": {"train": {"path": "train.jsonl"}, "fields": {"prompt": "prompt"}},
        "algorithm": {"kind": "grpo", "rollout_batch_size": 8, "num_generations": 4},
        "rewards": rewards,
        "cluster": {"device": "cpu"},
    }


@pytest.mark.parametrize(
    "reward", [{"fn": "numeric_match", "model": "x"}, {"weight": 2.0}], ids=["both", "neither"]
)
def test_a_reward_is_a_function_or_a_model(tmp_path, reward):
    with pytest.raises(ConfigError) as raised:
        validate_config(grpo_config(tmp_path, [reward]))
    (issue,) = raised.value.issues
    assert issue.path == "rewards[0]" and "exactly one of fn" in issue.message


def test_a_planned_reward_model_scores_in_the_worker_and_goes_stale(saved_run, tmp_path):
    from tests.conftest import write_toml

    model = str(saved_run / "checkpoints" / "last")
    config = grpo_config(tmp_path, [{"model": model, "weight": 0.5}, {"fn": "numeric_match"}])
    path = write_toml(tmp_path / "run.toml", config)
    plan = build_plan(path)
    (identity, _) = plan.plugins
    assert identity.used_by == "rewards[0].model" and identity.ref == model

    functions = build_reward_functions(plan)
    assert [(f.name, f.weight) for f in functions] == [
        ("reward_model", 0.5),
        ("numeric_match", 1.0),
    ]
    scores = functions[0].fn(["What is 1 + 1?"], ["2"])
    assert len(scores) == 1 and isinstance(scores[0], float)

    lock = tmp_path / "plan.lock"
    write_plan(plan, lock)
    weights = Path(identity.path)
    original = weights.read_bytes()
    try:
        weights.write_bytes(original[:-4] + b"\0\0\0\0")
        with pytest.raises(LockfileError, match="changed since planning"):
            read_plan(lock)
    finally:
        weights.write_bytes(original)
