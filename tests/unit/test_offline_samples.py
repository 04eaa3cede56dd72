"""Records -> token ids for the offline objectives: the planner's torch-free tokenizer agrees with
the worker's transformers one, and each kind of record becomes the sample it should."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout.config.model import ModelSection
from rollout.models import builtin
from rollout.models.samples import HfTextTokenizer, SampleError, SampleRules
from rollout.planner.inspect_model import inspect_model
from rollout.planner.tokenizer import load
from rollout.runtime.offline.data import encode_split

FIELDS = {
    "prompt": "prompt",
    "chosen": "chosen",
    "rejected": "rejected",
    "completion": "completion",
    "label": "label",
}
RECORDS = [
    {"prompt": "What is 12 + 7?", "chosen": "19", "rejected": "127", "completion": "19"},
    {"prompt": "héllo wörld 🙂 日本語", "chosen": "  two  spaces ", "rejected": "\n\t"},
    {"prompt": [{"role": "user", "content": "Hi"}], "chosen": "Hello!", "rejected": "Bye."},
]


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return HfTextTokenizer.of(tiny_llama)


@pytest.fixture(scope="module")
def planned():
    section = ModelSection(builtin="tiny-llama")
    return load(inspect_model(section, base_dir=Path.cwd()), section, base_dir=Path.cwd())


def rules(tokenizer, **kwargs) -> SampleRules:
    return SampleRules(tokenizer=tokenizer, fields=FIELDS, **kwargs)


@pytest.mark.parametrize("use_chat_template", [True, False])
@pytest.mark.parametrize("system_prompt", [None, "Be brief."])
def test_planner_and_worker_tokenize_pairs_the_same(hf, planned, use_chat_template, system_prompt):
    records = RECORDS if use_chat_template else RECORDS[:2]
    for record in records:
        kwargs = {"use_chat_template": use_chat_template, "system_prompt": system_prompt}
        assert rules(planned, **kwargs).pair(record) == rules(hf, **kwargs).pair(record)


def test_planner_and_worker_render_conversations_the_same(hf, planned):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5"},
    ]
    for add in (True, False):
        assert planned.chat(messages, add_generation_prompt=add) == hf.chat(
            messages, add_generation_prompt=add
        )


def test_pair_is_chat_prompt_then_completion_and_end_of_turn(hf, tiny_llama):
    pair = rules(hf).pair(RECORDS[0])
    text = tiny_llama.tokenizer.decode(pair.prompt)
    assert text == "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
    assert pair.chosen[-1] == pair.rejected[-1] == builtin.IM_END_ID
    assert tiny_llama.tokenizer.decode(pair.chosen[:-1]) == "19"
    assert pair.length == len(pair.prompt) + len(pair.rejected)


def test_judged_needs_a_boolean_label(hf):
    good = rules(hf).judged({**RECORDS[0], "label": True})
    assert good.desirable is True and good.completion[-1] == builtin.IM_END_ID
    with pytest.raises(SampleError) as raised:
        rules(hf).judged({**RECORDS[0], "label": "yes"})
    assert raised.value.role == "label" and "'label' is 'yes', not a boolean" in str(raised.value)


def test_completion_may_be_one_assistant_message(hf):
    as_text = rules(hf).pair(RECORDS[0])
    as_message = rules(hf).pair({**RECORDS[0], "chosen": [{"role": "assistant", "content": "19"}]})
    assert as_message == as_text


def test_prompt_and_completion_sft_learns_the_completion_only(hf):
    sample = rules(hf).sequence(RECORDS[0])
    prompt = rules(hf).prompt(RECORDS[0])
    assert sample.ids[: len(prompt)] == prompt
    assert sample.targets == [False] * len(prompt) + [True] * (len(sample.ids) - len(prompt))
    everything = rules(hf, completion_only_loss=False).sequence(RECORDS[0])
    assert everything.targets == [False] + [True] * (len(sample.ids) - 1)


def test_messages_sft_learns_every_assistant_turn_and_nothing_else(hf, tiny_llama):
    conversation = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "and 4+4?"},
        {"role": "assistant", "content": "8"},
    ]
    sample = SampleRules(tokenizer=hf, fields={"messages": "messages"}).sequence(
        {"messages": conversation}
    )
    learned = [i for i, t in zip(sample.ids, sample.targets, strict=True) if t]
    assert tiny_llama.tokenizer.decode(learned) == "5<|im_end|>\n8<|im_end|>\n"
    assert sample.ids == hf.chat(conversation, add_generation_prompt=False)


def test_messages_without_an_assistant_turn_are_refused(hf):
    with pytest.raises(SampleError, match="no assistant message"):
        SampleRules(tokenizer=hf, fields={"messages": "messages"}).sequence(
            {"messages": [{"role": "user", "content": "hi"}]}
        )


def test_chat_messages_need_the_chat_template(hf):
    with pytest.raises(SampleError, match="need the chat template") as raised:
        rules(hf, use_chat_template=False).pair(RECORDS[2])
    assert raised.value.role == "prompt"


def test_encode_split_names_the_record_that_is_too_long(hf):
    records = [RECORDS[0], {**RECORDS[0], "chosen": "1 2 3 4 5 6 7 8 9 " * 10}]
    with pytest.raises(ValueError, match=r"record 2 of data.jsonl is \d+ tokens, longer than"):
        encode_split("train", "data.jsonl", records, rules(hf), kind="dpo", max_length=40)


def test_kto_split_pairs_each_prompt_with_the_next_completion(hf):
    records = [
        {"prompt": "a?", "completion": "1", "label": True},
        {"prompt": "b?", "completion": "22", "label": False},
        {"prompt": "c?", "completion": "333", "label": True},
    ]
    split = encode_split("train", "x", records, rules(hf), kind="kto", max_length=64)
    completions = [s.completion for s in split.samples]
    assert split.mismatched == [completions[1], completions[2], completions[0]]


def test_smollm2_planner_tokenizer_agrees_when_its_dense_copy_exists(tmp_path):
    """SmolLM2's transformers files (rollout's cache of its dequantized GGUF) as a model.path."""
    from rollout.models.cache import cache_root

    caches = (cache_root(), Path.home() / ".cache" / "rollout")  # tests point the first elsewhere
    found = sorted(path for cache in caches for path in (cache / "gguf").glob("*/tokenizer.json"))
    if not found:
        pytest.skip("no dequantized SmolLM2 in the cache (run a SmolLM2 plan once)")
    from transformers import AutoTokenizer

    directory = found[0].parent
    section = ModelSection(path=str(directory))
    planned = load(inspect_model(section, base_dir=tmp_path), section, base_dir=tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    eos = json.loads((directory / "generation_config.json").read_text())["eos_token_id"]
    worker = HfTextTokenizer(tokenizer, tokenizer.chat_template, eos)
    assert planned is not None and planned.eos_token_id == worker.eos_token_id
    for record in RECORDS:
        for system_prompt in (None, "You are a calculator."):
            assert rules(planned, system_prompt=system_prompt).pair(record) == rules(
                worker, system_prompt=system_prompt
            ).pair(record)
