"""Loading the planned model: builtin, Hugging Face directory and GGUF; the tokenizer and chat
template overrides; prompts rendered with the chat template."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from rollout.config.model import ModelSection
from rollout.engines.base import SamplingParams
from rollout.engines.hf.engine import HfEngine
from rollout.models import builtin
from rollout.models.builtin_build import build_tiny
from rollout.models.loading import apply_chat_template, load_model
from rollout.planner.inspect_model import inspect_model


def _load(section: ModelSection, base_dir: Path, *, dtype: str = "float32"):
    facts = inspect_model(section, base_dir=base_dir)
    return load_model(facts, section, dtype=dtype, device="cpu", base_dir=base_dir)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny-llama Hugging Face directory to point model.path at (tests may copy it, not edit)."""
    return build_tiny("tiny-llama", tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.mark.parametrize("name", builtin.TINY_MODELS)
def test_builtin(name, rollout_cache):
    loaded = _load(ModelSection(builtin=name), Path.cwd(), dtype="float32")
    config = builtin.hf_config(name)
    assert type(loaded.model).__name__ == config["architectures"][0]
    assert loaded.model.dtype == torch.float32
    assert loaded.chat_template == builtin.CHAT_TEMPLATE
    assert loaded.eos_token_ids == [builtin.IM_END_ID]
    assert loaded.pad_token_id == builtin.ENDOFTEXT_ID


def test_hf_directory_in_bfloat16(tiny_dir, tmp_path):
    loaded = _load(ModelSection(path=str(tiny_dir)), tmp_path, dtype="bfloat16")
    assert loaded.model.dtype == torch.bfloat16
    assert len(loaded.tokenizer) == builtin.VOCAB_SIZE


def test_chat_template_override_string_and_file(tiny_dir, tmp_path):
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    loaded = _load(ModelSection(path=str(tiny_dir), chat_template=template), tmp_path)
    assert loaded.chat_template == template
    assert loaded.tokenizer.chat_template == template

    (tmp_path / "short.jinja").write_text(template, encoding="utf-8")
    section = ModelSection(path=str(tiny_dir), chat_template="short.jinja")  # relative to base
    loaded = _load(section, tmp_path)
    ids = apply_chat_template(loaded.tokenizer, loaded.chat_template, "hi", "sys")
    assert loaded.tokenizer.decode(ids) == "[sys][hi]"


def test_tokenizer_override_brings_its_own_template(tiny_dir, tmp_path):
    other = tmp_path / "tokenizer"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, other)
    (other / "chat_template.jinja").write_text("{{ messages[-1]['content'] }}!", encoding="utf-8")
    loaded = _load(ModelSection(path=str(tiny_dir), tokenizer="tokenizer"), tmp_path)
    ids = apply_chat_template(loaded.tokenizer, loaded.chat_template, "hi", None)
    assert loaded.tokenizer.decode(ids) == "hi!"


def test_pad_token_falls_back_to_eos(tiny_dir, tmp_path):
    model = tmp_path / "no-pad"
    shutil.copytree(tiny_dir, model)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    del tokenizer_config["pad_token"]
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    loaded = _load(ModelSection(path=str(model)), tmp_path)
    assert loaded.pad_token_id == loaded.tokenizer.pad_token_id == builtin.IM_END_ID


def test_apply_chat_template(tiny_llama):
    tokenizer = tiny_llama.tokenizer
    ids = apply_chat_template(tokenizer, tiny_llama.chat_template, "What is 2 + 3?", "Be brief.")
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    no_system = apply_chat_template(tokenizer, tiny_llama.chat_template, "hi", None)
    assert tokenizer.decode(no_system).startswith("<|im_start|>user\nhi")
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tokenizer, None, "hi", None)


@pytest.mark.slow
def test_smollm2_gguf_answers_with_the_chat_template(smollm2):
    assert smollm2.model.dtype == torch.float32
    assert getattr(smollm2.model.config, "quantization_config", None) is None  # dense
    assert all(p.requires_grad for p in smollm2.model.parameters())
    assert smollm2.eos_token_ids == [2]  # <|im_end|>
    prompt = apply_chat_template(smollm2.tokenizer, smollm2.chat_template, "What is 2 + 3?", None)
    engine = HfEngine(
        smollm2.model,
        eos_token_ids=smollm2.eos_token_ids,
        pad_token_id=smollm2.pad_token_id,
        tokenizer=smollm2.tokenizer,
    )
    start = time.perf_counter()
    (answer,) = engine.generate([prompt], SamplingParams(max_new_tokens=32, temperature=0.0))
    seconds = time.perf_counter() - start
    print(f"\nSmolLM2 greedy: {answer.text!r} ({len(answer.token_ids)} tokens, {seconds:.2f} s)")
    assert "5" in answer.text
    assert answer.finish_reason == "eos"
