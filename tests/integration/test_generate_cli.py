"""`rollout generate` as a user runs it, on the tiny model: what the output holds, n, log-probs,
Parquet, checkpoints, resuming after Ctrl-C and SIGKILL, and every bad input -> exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.inference.output import parts_path, progress_path

runner = CliRunner()

QUESTIONS = [f"What is {i} + {i + 3}? Answer with just the number." for i in range(12)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory):
    """ROLLOUT_CACHE for this module (the tiny model is built there once), here and in children."""
    path = tmp_path_factory.mktemp("rollout-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ROLLOUT_CACHE", str(path))
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield path


@pytest.fixture
def work(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    records = [
        {"prompt": q, "answer": str(2 * i + 3), "id": f"q{i}"} for i, q in enumerate(QUESTIONS)
    ]
    Path("prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path


def generate(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["generate", *args])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


TINY = ("--model", "tiny-llama", "--max-new-tokens", "8")


def test_outputs_hold_every_sample_with_its_prompt_fields(work):
    code, output = generate("--prompts", "prompts.jsonl", "--out", "out.jsonl", *TINY, "--n", "3")
    assert code == 0, output
    assert "wrote out.jsonl: 36 records for 12 prompts" in output
    records = read_jsonl("out.jsonl")
    assert [(r["prompt_index"], r["sample_index"]) for r in records] == [
        (p, s) for p in range(12) for s in range(3)
    ]
    from rollout.config.model import ModelSection
    from rollout.models.loading import apply_chat_template, load_model
    from rollout.planner.inspect_model import inspect_model

    facts = inspect_model(ModelSection(builtin="tiny-llama"), base_dir=work)
    loaded = load_model(facts, ModelSection(builtin="tiny-llama"), dtype="float32", device="cpu")
    for record in records:
        assert record["prompt"] == QUESTIONS[record["prompt_index"]]
        assert record["id"] == f"q{record['prompt_index']}"  # every field is carried over
        assert record["completion_tokens"] == len(record["completion_ids"]) <= 8
        assert record["finish_reason"] in ("eos", "stop", "length")
        assert "logprobs" not in record
        expected = apply_chat_template(
            loaded.tokenizer, loaded.chat_template, record["prompt"], None
        )
        assert record["prompt_tokens"] == len(expected)
        assert record["completion"] == loaded.tokenizer.decode(
            record["completion_ids"], skip_special_tokens=True
        )
    # Three samples of one prompt are not three copies.
    assert len({tuple(r["completion_ids"]) for r in records[:3]}) > 1


def test_logprobs_and_sampling_flags(work):
    code, output = generate(
        "--prompts", "prompts.jsonl", "--out", "out.jsonl", *TINY, "--logprobs",
        "--temperature", "0", "--limit", "4", "--carry", "id",
    )  # fmt: skip
    assert code == 0, output
    records = read_jsonl("out.jsonl")
    assert len(records) == 4
    for record in records:
        assert set(record) == {
            "prompt_index", "sample_index", "id", "completion", "completion_ids",
            "completion_tokens", "prompt_tokens", "finish_reason", "logprobs",
        }  # fmt: skip
        assert len(record["logprobs"]) == record["completion_tokens"]
        assert all(lp <= 0.0 for lp in record["logprobs"])
    settings = json.loads(progress_path(Path("out.jsonl")).read_text())["settings"]
    assert settings["temperature"] == 0.0 and settings["limit"] == 4


def test_same_seed_same_output_and_parquet_holds_the_same_records(work):
    pq = pytest.importorskip("pyarrow.parquet")

    def run(out: str, seed: str = "11") -> None:
        code, output = generate(
            "--prompts", "prompts.jsonl", "--out", out, *TINY, "--n", "2", "--seed", seed,
            "--batch-size", "6",
        )  # fmt: skip
        assert code == 0, output

    run("a.jsonl")
    run("b.jsonl")
    assert Path("a.jsonl").read_bytes() == Path("b.jsonl").read_bytes()
    run("c.parquet")
    assert pq.read_table("c.parquet").to_pylist() == read_jsonl("a.jsonl")
    assert not parts_path(Path("c.parquet")).exists()
    run("d.jsonl", seed="12")
    assert Path("d.jsonl").read_bytes() != Path("a.jsonl").read_bytes()


def test_a_finished_job_is_not_generated_again(work):
    assert generate("--prompts", "prompts.jsonl", "--out", "o.jsonl", *TINY)[0] == 0
    before = Path("o.jsonl").read_bytes()
    code, output = generate("--prompts", "prompts.jsonl", "--out", "o.jsonl", *TINY)
    assert code == 0 and "already complete: 12 records for 12 prompts" in output
    assert Path("o.jsonl").read_bytes() == before


def test_generate_from_a_runs_checkpoint_by_path_and_by_run_id(work, base_config, config_file):
    """A run's checkpoint (saved as training saves it) and its plan's generation settings."""
    from rollout.config.model import ModelSection
    from rollout.models.loading import load_model
    from rollout.planner.builder import build_plan
    from rollout.planner.inspect_model import inspect_model
    from rollout.planner.lockfile import write_plan
    from rollout.runtime.checkpoint import save_checkpoint
    from rollout.storage import open_store

    base_config["run"]["output_dir"] = str(work / "runs")
    base_config["generation"]["max_new_tokens"] = 5
    plan = build_plan(config_file(base_config))
    run_dir = Path(plan.derived.run_dir)
    write_plan(plan, run_dir / "plan.lock")
    facts = inspect_model(ModelSection(builtin="tiny-llama"), base_dir=work)
    loaded = load_model(facts, ModelSection(builtin="tiny-llama"), dtype="float32", device="cpu")
    step = save_checkpoint(
        plan.derived.artifacts, 3, model=loaded.model, tokenizer=loaded.tokenizer,
        optimizer=None, scheduler=None, trainer_state={}, keep_last=2,
    )  # fmt: skip
    store = open_store(plan.derived.store)
    store.create_run(
        plan.run_id, name="t", plan_sha256="x", plan_path=str(run_dir / "plan.lock"),
        run_dir=str(run_dir),
    )  # fmt: skip
    store.close()

    code, output = generate(
        "--prompts", "prompts.jsonl", "--out", "a.jsonl", "--checkpoint", str(step)
    )
    assert code == 0, output
    assert all(r["completion_tokens"] <= 5 for r in read_jsonl("a.jsonl"))  # the run's setting
    code, output = generate(
        "--prompts", "prompts.jsonl", "--out", "b.jsonl", "--checkpoint", plan.run_id,
        "--store", plan.derived.store,
    )  # fmt: skip
    assert code == 0, output
    assert f"checkpoint {step}" in output
    assert Path("a.jsonl").read_bytes() == Path("b.jsonl").read_bytes()
    code, output = generate(
        "--prompts", "prompts.jsonl", "--out", "c.jsonl", "--checkpoint", str(run_dir)
    )
    assert code == 0, output
    assert Path("c.jsonl").read_bytes() == Path("a.jsonl").read_bytes()

    # A weight file that no longer matches the manifest is refused before it is loaded.
    weights = Path(step) / "model" / "model.safetensors"
    damaged = bytearray(weights.read_bytes())
    damaged[-1] ^= 0xFF
    weights.write_bytes(bytes(damaged))
    for checkpoint in (str(step), str(run_dir)):
        code, output = generate(
            "--prompts", "prompts.jsonl", "--out", "d.jsonl", "--checkpoint", checkpoint
        )
        assert code == 2, output
        assert "does not match its manifest.json" in output and "model.safetensors" in output
        assert "rollout checkpoints verify" in output and "Traceback" not in output
    assert not Path("d.jsonl").exists()


# --- resuming -------------------------------------------------------------------------------------


PROMPTS = 24
HOLD_AFTER = 10
MANY = [{"prompt": f"Count to {i}.", "n": i} for i in range(PROMPTS)]
JOB = ("--prompts", "many.jsonl", *TINY, "--n", "2", "--max-batch-size", "4", "--seed", "5")
"""24 prompts, 2 per chunk of 4 completions: 12 chunks, of which the resumed run writes 7."""

HELD = f"""
import sys, time
from pathlib import Path
from rollout.engines.hf.engine import HfEngine

generate, chunks = HfEngine.generate, []

def held(self, prompts, params):
    chunks.append(len(prompts))
    if len(chunks) > {HOLD_AFTER // 2}:  # a chunk being sampled: the test's signal comes now
        Path("held").touch()
        time.sleep(120)
    return generate(self, prompts, params)

HfEngine.generate = held
from rollout.cli.app import main
sys.argv = ["rollout", *sys.argv[1:]]
main()
"""
"""`rollout generate` whose engine stops on the chunk after the first HOLD_AFTER prompts (2 a
chunk), so that a signal always lands mid-job, while a chunk is sampled, however fast the
machine."""


@contextmanager
def held_job(work: Path, cache: Path) -> Iterator[subprocess.Popen]:
    """`rollout generate` of JOB into out.jsonl, in its own process, held mid-job (killed on the
    way out if the test has not ended it)."""
    process = start(work, cache)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)


def start(work: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "ROLLOUT_CACHE": str(cache), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.Popen(
        [sys.executable, "-c", HELD, "generate", *JOB, "--out", "out.jsonl"],
        cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # A shell that runs the tests in the background starts them with SIGINT ignored, and
        # Python then installs no KeyboardInterrupt handler: give the job Ctrl-C back.
        preexec_fn=_default_sigint,
    )  # fmt: skip


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_until_held(work: Path, process: subprocess.Popen) -> int:
    """Prompts done once the job is held (the process still running), as its progress says."""
    deadline = time.monotonic() + 120
    while not (work / "held").exists():
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, "the job never got to its hold"
        time.sleep(0.01)
    return json.loads(progress_path(work / "out.jsonl").read_text())["prompts_done"]


def finish_and_compare(work: Path) -> None:
    """Run the job to its end; it must hold what an uninterrupted run writes, byte for byte."""
    code, output = generate(*JOB, "--out", "out.jsonl")
    assert code == 0, output
    assert f"resuming after {HOLD_AFTER} done" in output
    resumed = read_jsonl(work / "out.jsonl")
    keys = [(r["prompt_index"], r["sample_index"]) for r in resumed]
    assert keys == [(p, s) for p in range(PROMPTS) for s in range(2)]  # none missing or twice
    assert [r["n"] for r in resumed[::2]] == list(range(PROMPTS))
    code, output = generate(*JOB, "--out", "reference.jsonl")
    assert code == 0, output
    assert (work / "reference.jsonl").read_bytes() == (work / "out.jsonl").read_bytes()


def test_resume_after_sigkill_loses_and_repeats_nothing(work, cache):
    """SIGKILL while a chunk is sampled; a kill can also land while a chunk is being written,
    leaving half a record after the last durable chunk: the resumed run cuts it off."""
    Path("many.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MANY))
    out = work / "out.jsonl"
    with held_job(work, cache) as first:
        killed_at = wait_until_held(work, first)
        first.kill()  # SIGKILL: no handler runs
        first.wait(timeout=60)
    assert killed_at == HOLD_AFTER
    with out.open("ab") as torn:
        torn.write(b'{"prompt_index": 10, "sample_index": 0, "prom')
    finish_and_compare(work)


def test_ctrl_c_stops_at_once_and_resumes(work, cache):
    """SIGINT while a chunk is sampled: that chunk is dropped, every earlier one is kept."""
    Path("many.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MANY))
    out = work / "out.jsonl"
    with held_job(work, cache) as first:
        assert wait_until_held(work, first) == HOLD_AFTER
        first.send_signal(signal.SIGINT)
        output = first.communicate(timeout=60)[0]
    assert first.returncode == 130, output
    assert f"interrupted: {HOLD_AFTER} of {PROMPTS} prompts are in out.jsonl" in output
    assert "run the same command again to continue" in output
    assert json.loads(progress_path(out).read_text())["prompts_done"] == HOLD_AFTER
    finish_and_compare(work)


def test_max_batch_size_sizes_the_engines_decode_batch(work, monkeypatch):
    """--max-batch-size (serve's name and the config's generation.max_batch_size; --batch-size
    is the same option) is the engine's decode width and the completions of a chunk."""
    from rollout.engines.hf.engine import HfEngine

    widths, chunks = [], []
    init, sample = HfEngine.__init__, HfEngine.generate

    def spy_init(self, *args, **kwargs):
        widths.append(kwargs["max_batch_size"])
        init(self, *args, **kwargs)

    def spy_generate(self, prompts, params):
        chunks.append(len(prompts) * params.n)
        return sample(self, prompts, params)

    monkeypatch.setattr(HfEngine, "__init__", spy_init)
    monkeypatch.setattr(HfEngine, "generate", spy_generate)
    job = ("--prompts", "prompts.jsonl", *TINY, "--n", "2", "--limit", "5")
    code, output = generate(*job, "--max-batch-size", "6", "--out", "a.jsonl")
    assert code == 0, output
    assert widths == [6] and chunks == [6, 4]  # 3 prompts x 2 samples, then the 2 left
    assert json.loads(progress_path(Path("a.jsonl")).read_text())["settings"]["batch_size"] == 6
    code, output = generate(*job, "--batch-size", "6", "--out", "b.jsonl")
    assert code == 0, output
    assert widths == [6, 6] and Path("a.jsonl").read_bytes() == Path("b.jsonl").read_bytes()


# --- mistakes -> exit 2 ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--prompts", "missing.jsonl"), "prompt file not found"),
        (("--prompts", "prompts.jsonl", "--field", "question"), "record 1 (line 1)"),
        (("--prompts", "prompts.jsonl", "--max-new-tokens", "1020"), "beyond the model's context of 1024"),
        (("--prompts", "prompts.jsonl", "--model", "no-such-model"), "no model 'no-such-model'"),
        (("--prompts", "prompts.jsonl", "--temperature", "-1"), "--temperature: must be at least 0"),
        (("--prompts", "prompts.jsonl", "--carry", "nope"), "no record of"),
        (("--prompts", "prompts.jsonl", "--out", "out.csv"), "cannot tell the format of out.csv"),
    ],
)  # fmt: skip
def test_mistakes_exit_2_with_one_clear_message(work, args, expected):
    defaults = {"--out": "out.jsonl", "--model": "tiny-llama"}
    given = dict(zip(args[::2], args[1::2], strict=True))
    argv = [item for key, value in {**defaults, **given}.items() for item in (key, value)]
    code, output = generate(*argv)
    assert code == 2, output
    assert expected in " ".join(output.split()), output
    assert "error" in output
    assert not Path("out.jsonl").exists()  # nothing is started before everything checks out


def test_an_output_of_other_settings_is_not_resumed(work):
    assert generate("--prompts", "prompts.jsonl", "--out", "o.jsonl", *TINY, "--limit", "2")[0] == 0
    code, output = generate("--prompts", "prompts.jsonl", "--out", "o.jsonl", *TINY, "--limit", "3")
    assert code == 2
    assert "holds the output of another job: changed limit 2 -> 3" in " ".join(output.split())
    Path("mine.jsonl").write_text("{}\n")
    code, output = generate("--prompts", "prompts.jsonl", "--out", "mine.jsonl", *TINY)
    assert code == 2 and "--overwrite" in output


def test_cuda_graphs_required_off_a_gpu_exit_2(work, base_config, config_file):
    """generation.cuda_graphs = true in the config: refused on the CPU before any weights load,
    as `rollout plan` refuses it."""
    base_config["generation"]["cuda_graphs"] = True
    config = config_file(base_config)
    code, output = generate(
        "--prompts", "prompts.jsonl", "--config", str(config), "--device", "cpu", "--out", "o.jsonl"
    )  # fmt: skip
    assert code == 2, output
    assert "CUDA graphs need a CUDA GPU, and this runs on cpu" in " ".join(output.split())
    assert not Path("o.jsonl").exists()
