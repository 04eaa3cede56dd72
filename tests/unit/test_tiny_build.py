"""Building the builtin tiny models: a byte-level tokenizer of exactly 512 ids, identical bytes on
every build, and one cache directory however many processes ask at once."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rollout.models import builtin
from rollout.models.builtin_build import build_tiny, builtin_model_dir

BUILD_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return tiny_llama.tokenizer


def test_vocabulary_and_special_tokens(tokenizer):
    assert len(tokenizer) == builtin.VOCAB_SIZE
    assert tokenizer.convert_tokens_to_ids(list(builtin.SPECIAL_TOKENS)) == [0, 1, 2]
    config = builtin.hf_config("tiny-llama")
    assert tokenizer.bos_token_id == config["bos_token_id"] == builtin.IM_START_ID
    assert tokenizer.eos_token_id == config["eos_token_id"] == builtin.IM_END_ID
    assert tokenizer.pad_token_id == config["pad_token_id"] == builtin.ENDOFTEXT_ID


@settings(max_examples=200, deadline=None)
@given(text=st.text())
@example(text="What is 12 + 7? héllo wörld 🙂 日本語 e\u0301 \x00\r\n\t  two  spaces ")
def test_any_text_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < builtin.VOCAB_SIZE for i in ids)
    assert tokenizer.decode(ids) == text


def test_merges_were_learned_from_the_corpus(tokenizer):
    # Common words and numbers are single tokens; the byte fallback handles everything else.
    assert len(tokenizer.tokenize(" the answer is")) == 3


def test_chat_template_renders(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_config_json_is_the_spec(tmp_path):
    directory = build_tiny("tiny-qwen2", tmp_path / "qwen2")
    assert json.loads((directory / "config.json").read_text()) == builtin.hf_config("tiny-qwen2")


def test_two_builds_are_byte_identical(tmp_path, rollout_cache):
    first = build_tiny("tiny-llama", tmp_path / "first")
    cached = builtin_model_dir("tiny-llama")  # built by another test or fixture, maybe elsewhere
    for name in BUILD_FILES:
        assert (first / name).read_bytes() == (cached / name).read_bytes(), name


def _ask_for_model(cache: str, barrier, results) -> None:
    os.environ["ROLLOUT_CACHE"] = cache
    barrier.wait()  # start building together, to race for the rename
    results.put(str(builtin_model_dir("tiny-qwen2")))


def test_concurrent_builders_end_with_one_directory(tmp_path):
    context = multiprocessing.get_context("spawn")  # fresh interpreters, like torchrun workers
    barrier, results = context.Barrier(2), context.Queue()
    workers = [
        context.Process(target=_ask_for_model, args=(str(tmp_path), barrier, results))
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    paths = {results.get(timeout=120) for _ in workers}
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0

    assert len(paths) == 1
    built = Path(paths.pop())
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no scratch left behind
    # Built in another process, the bytes still equal a build here.
    here = build_tiny("tiny-qwen2", tmp_path / "here")
    for name in BUILD_FILES:
        assert (built / name).read_bytes() == (here / name).read_bytes(), name
