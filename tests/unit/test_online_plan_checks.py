"""`rollout plan` counts the prompts of online runs (GRPO, RLOO, PPO, REINFORCE++) with the model's
tokenizer, chat template and system prompt applied as the worker applies them, and refuses a prompt
longer than generation.max_prompt_tokens, naming the file, the record and line, its length, the
limit and what to change. GGUF models are counted once their tokenizer is readable without
transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.config.model import ModelSection
from rollout.errors import PlanError
from rollout.planner.builder import build_plan
from rollout.planner.inspect_model import inspect_model
from rollout.planner.tokenizer import dense_gguf_directory, load
from tests.conftest import TRAIN_RECORDS, write_toml

LONG = "What is the sum of these numbers: " + " + ".join(str(i) for i in range(40)) + "?"

ALGORITHMS = {
    "grpo": {"kind": "grpo", "rollout_batch_size": 8, "num_generations": 4},
    "rloo": {"kind": "rloo", "rollout_batch_size": 8, "num_generations": 4},
    "reinforce_pp": {"kind": "reinforce_pp", "rollout_batch_size": 8, "num_generations": 4},
    "ppo": {"kind": "ppo", "rollout_batch_size": 8, "num_generations": 1, "kl_coef": 0.05},
}


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def online_config(
    tmp_path: Path,
    records: list[dict[str, Any]] | None = None,
    *,
    kind: str = "grpo",
    eval_records: list[dict[str, Any]] | None = None,
    eval_limit: int | None = None,
    model: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    **generation: Any,
) -> Path:
    write_jsonl(tmp_path / "train.jsonl", TRAIN_RECORDS if records is None else records)
    data_section: dict[str, Any] = {
        "train": {"path": "train.jsonl"},
        "fields": {"prompt": "prompt", "answer": "answer"},
        **(data or {}),
    }
    if eval_records is not None:
        write_jsonl(tmp_path / "eval.jsonl", eval_records)
        data_section["eval"] = {"path": "eval.jsonl"}
        if eval_limit is not None:
            data_section["eval"]["limit"] = eval_limit
    config = {
        "run": {"name": "t", "output_dir": str(tmp_path / "runs")},
        "model": model or {"builtin": "tiny-llama"},
        "data": data_section,
        "algorithm": {**ALGORITHMS[kind], "max_steps": 2},
        "generation": {"max_new_tokens": 8, "max_prompt_tokens": 32, **generation},
        "rewards": [{"fn": "numeric_match"}],
        "cluster": {"device": "cpu"},
    }
    return write_toml(tmp_path / "run.toml", config)


def plan_issues(path: Path) -> list:
    with pytest.raises(PlanError) as raised:
        build_plan(path)
    return raised.value.issues


def with_long_prompt(at: int, prompt: str = LONG) -> list[dict[str, Any]]:
    records = [dict(r) for r in TRAIN_RECORDS]
    records[at]["prompt"] = prompt
    return records


def planner_length(prompt: str, *, system_prompt: str | None = None, chat: bool = True) -> int:
    from rollout.models.samples import SampleRules

    section = ModelSection(builtin="tiny-llama")
    tokenizer = load(inspect_model(section, base_dir=Path.cwd()), section, base_dir=Path.cwd())
    rules = SampleRules(
        tokenizer=tokenizer,
        fields={"prompt": "prompt"},
        use_chat_template=chat,
        system_prompt=system_prompt,
    )
    return len(rules.generation_prompt({"prompt": prompt}))


@pytest.mark.parametrize("kind", sorted(ALGORITHMS))
def test_every_online_kind_plans_prompts_that_fit(tmp_path, kind):
    plan = build_plan(online_config(tmp_path, kind=kind, eval_records=TRAIN_RECORDS[:4]))
    assert {f.split: f.num_records for f in plan.data} == {"train": 16, "eval": 4}


@pytest.mark.parametrize("kind", sorted(ALGORITHMS))
def test_a_prompt_longer_than_max_prompt_tokens_names_record_length_limit_and_fix(tmp_path, kind):
    length = planner_length(LONG)
    assert length > 32
    (issue,) = plan_issues(online_config(tmp_path, with_long_prompt(2), kind=kind))
    assert issue.path == "generation.max_prompt_tokens"
    assert issue.message == (
        f"record 3 (line 3) of {tmp_path / 'train.jsonl'}: prompt 'prompt' is {length} tokens "
        "(with the chat template), longer than max_prompt_tokens 32"
    )
    assert issue.hint == (
        f"raise generation.max_prompt_tokens to at least {length}, or shorten or drop the record"
    )


def test_the_planner_counts_what_the_worker_encodes(tiny_llama):
    """The trainer's encode (rollout.runtime.online.trainer): the chat template over one user turn,
    after the system prompt; without the template, the text with the tokenizer's special tokens."""
    from rollout.models.loading import apply_chat_template

    for prompt in (LONG, "héllo wörld 🙂 日本語", "  two  spaces \n"):
        for system_prompt in (None, "You are a calculator."):
            worker = apply_chat_template(
                tiny_llama.tokenizer, tiny_llama.chat_template, prompt, system_prompt
            )
            assert planner_length(prompt, system_prompt=system_prompt) == len(worker)
        plain = tiny_llama.tokenizer.encode(prompt, add_special_tokens=True)
        assert planner_length(prompt, chat=False) == len(plain)


def test_the_system_prompt_counts(tmp_path):
    system_prompt = "You are a careful calculator. " * 3
    path = online_config(tmp_path, data={"system_prompt": system_prompt})
    length = max(planner_length(r["prompt"], system_prompt=system_prompt) for r in TRAIN_RECORDS)
    assert length > 32 >= planner_length(TRAIN_RECORDS[0]["prompt"])
    (issue,) = plan_issues(path)
    assert "tokens (with the chat template and the system prompt)" in issue.message


def test_without_the_chat_template_the_plain_text_counts(tmp_path):
    path = online_config(tmp_path, with_long_prompt(0), data={"use_chat_template": False})
    (issue,) = plan_issues(path)
    length = planner_length(LONG, chat=False)
    assert f"is {length} tokens (without a chat template)" in issue.message


def test_many_long_prompts_make_one_issue_at_the_longest(tmp_path):
    records = with_long_prompt(1)
    records[4]["prompt"] = LONG + " And then add 1000?"
    records[9]["prompt"] = LONG
    longest = planner_length(records[4]["prompt"])
    (issue,) = plan_issues(online_config(tmp_path, records))
    assert issue.message.startswith(f"record 5 (line 5) of {tmp_path / 'train.jsonl'}: ")
    assert issue.message.endswith(
        f"is {longest} tokens (with the chat template), longer than max_prompt_tokens 32 (the "
        "longest of 3 records over the limit; the first is record 2 (line 2))"
    )
    assert f"at least {longest}," in issue.hint


def test_the_eval_split_is_checked_up_to_its_limit(tmp_path):
    eval_records = with_long_prompt(3)
    assert build_plan(online_config(tmp_path, eval_records=eval_records, eval_limit=3))
    (issue,) = plan_issues(online_config(tmp_path, eval_records=eval_records, eval_limit=4))
    assert issue.message.startswith(f"record 4 (line 4) of {tmp_path / 'eval.jsonl'}: prompt")


def test_parquet_prompts_are_checked_too(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(with_long_prompt(5)), tmp_path / "train.parquet")
    path = online_config(tmp_path)
    path.write_text(path.read_text().replace('"train.jsonl"', '"train.parquet"'))
    (issue,) = plan_issues(path)
    assert issue.message.startswith(f"record 6 of {tmp_path / 'train.parquet'}: prompt 'prompt'")


def test_a_prompt_that_leaves_no_room_for_the_completion_says_which_knobs(tmp_path):
    length = planner_length(LONG)
    path = online_config(tmp_path, with_long_prompt(0), max_new_tokens=1024 - length + 1)
    issue = next(i for i in plan_issues(path) if i.path == "generation.max_prompt_tokens")
    assert issue.hint == (
        f"raise generation.max_prompt_tokens to at least {length} and lower "
        f"generation.max_new_tokens to at most {1024 - length} (the model's context is 1024 "
        "tokens), or shorten or drop the record"
    )


def test_the_cli_refuses_with_exit_code_2_and_no_traceback(tmp_path):
    path = online_config(tmp_path, with_long_prompt(6))
    result = CliRunner().invoke(app, ["plan", "--config", str(path), "-o", str(tmp_path / "p")])
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert "record 7 (line 7)" in output and "longer than max_prompt_tokens 32" in output
    assert "raise generation.max_prompt_tokens to at least" in output
    assert "Traceback" not in result.output
    assert not (tmp_path / "p").exists()


# --- GGUF ----------------------------------------------------------------------------------------


GGUF_EOS = 7


@pytest.fixture
def gguf_model(tmp_path, monkeypatch):
    """A qwen2 GGUF header (the planner reads nothing else) and an empty ROLLOUT_CACHE."""
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    monkeypatch.setenv("ROLLOUT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in {
        "context_length": 1024,
        "embedding_length": 32,
        "block_count": 2,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "feed_forward_length": 64,
    }.items():
        writer.add_uint32(f"qwen2.{key}", value)
    writer.add_uint32("general.file_type", 1)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(512)])
    writer.add_uint32("tokenizer.ggml.eos_token_id", GGUF_EOS)
    writer.add_string("tokenizer.chat_template", "{{ messages[0]['content'] }}")
    writer.add_tensor_info("token_embd.weight", (512, 32), np.dtype(np.float32), 0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def tokenizer_files(directory: Path) -> Path:
    """The tiny model's tokenizer as transformers saves one: what a worker's dense copy holds."""
    from rollout.models import builtin
    from rollout.models.builtin_build import tiny_tokenizer

    directory.mkdir(parents=True)
    tiny_tokenizer().save(str(directory / "tokenizer.json"))
    endoftext, im_start, im_end = builtin.SPECIAL_TOKENS
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": im_end, "bos_token": im_start, "pad_token": endoftext})
    )
    (directory / "chat_template.jinja").write_text(builtin.CHAT_TEMPLATE)
    eos = builtin.hf_config("tiny-llama")["eos_token_id"]
    (directory / "config.json").write_text(json.dumps({"eos_token_id": eos}))
    return directory


def test_a_gguf_model_is_not_counted_before_its_first_run(tmp_path, gguf_model):
    section = ModelSection(path=str(gguf_model))
    assert load(inspect_model(section, base_dir=tmp_path), section, base_dir=tmp_path) is None
    assert build_plan(online_config(tmp_path, with_long_prompt(0), model={"path": "m.gguf"}))


def test_a_gguf_model_is_counted_with_the_tokenizer_of_its_dense_copy(tmp_path, gguf_model):
    section = ModelSection(path=str(gguf_model))
    facts = inspect_model(section, base_dir=tmp_path)
    tokenizer_files(dense_gguf_directory(facts.fingerprint))
    assert load(facts, section, base_dir=tmp_path) is not None
    path = online_config(tmp_path, with_long_prompt(0), model={"path": "m.gguf"})
    (issue,) = plan_issues(path)
    assert issue.path == "generation.max_prompt_tokens"
    assert f"is {planner_length(LONG)} tokens (with the chat template)" in issue.message


def test_a_gguf_model_is_counted_with_model_tokenizer(tmp_path, gguf_model):
    tokenizer_files(tmp_path / "tok")
    model = {"path": "m.gguf", "tokenizer": "tok"}
    (issue,) = plan_issues(online_config(tmp_path, with_long_prompt(1), model=model))
    assert issue.message.startswith(f"record 2 (line 2) of {tmp_path / 'train.jsonl'}: prompt")
    section = ModelSection(path="m.gguf", tokenizer="tok")
    tokenizer = load(inspect_model(section, base_dir=tmp_path), section, base_dir=tmp_path)
    assert tokenizer is not None and tokenizer.eos_token_id == GGUF_EOS  # not tok's own (2)


def test_the_planner_looks_where_the_worker_keeps_the_dense_copy(tmp_path, monkeypatch):
    from rollout.models.loading import dense_gguf_dir

    monkeypatch.setenv("ROLLOUT_CACHE", str(tmp_path))
    fingerprint = "0123456789abcdef" * 4
    dense = dense_gguf_directory(fingerprint)
    dense.mkdir(parents=True)  # there already, so the worker's helper builds nothing
    assert dense_gguf_dir(str(tmp_path / "m.gguf"), fingerprint) == dense
    shutil.rmtree(dense)
