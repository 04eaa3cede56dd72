"""Checkpoints round-trip weights, optimizer, scheduler and RNG exactly; saves are atomic, pruned,
loadable by transformers, and free of pickle."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rollout.runtime import checkpoint
from rollout.runtime.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    prune,
    save_checkpoint,
)
from rollout.runtime.manifest import MANIFEST

VOCAB = 64
BATCH = torch.tensor([[1, 5, 9, 13, 2], [3, 4, 60, 7, 8]])
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}


def tiny_model(seed: int, *, tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="w1")


class Training:
    """A tiny model with AdamW and a warmup schedule, stepped on a fixed batch."""

    def __init__(self, seed: int, *, tied: bool = False):
        self.model = tiny_model(seed, tied=tied)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / 4)
        )

    def step(self) -> None:
        self.model(input_ids=BATCH, labels=BATCH).loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()

    def save(self, root: Path, step: int, tokenizer, *, keep_last: int = 3, **state) -> Path:
        return save_checkpoint(
            root,
            step,
            model=self.model,
            tokenizer=tokenizer,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            trainer_state={"step": step, **state},
            keep_last=keep_last,
        )

    def load(self, path: Path) -> dict:
        return load_checkpoint(
            path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler
        )


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    left, right = a.state_dict(), b.state_dict()
    assert left.keys() == right.keys()
    for key in left:
        assert torch.equal(left[key], right[key]), key


def assert_same(a, b, where: str = "") -> None:
    """Equal values of equal types, down to each tensor's dtype (a tuple is not a list)."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b) and a.dtype == b.dtype, where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, where


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_then_one_more_step_matches(tmp_path: Path, tokenizer, tied: bool):
    original = Training(seed=0, tied=tied)
    original.step()
    original.step()
    path = original.save(tmp_path, 2, tokenizer, cursor={"0": {"epoch": 1, "position": 3}})

    restored = Training(seed=1, tied=tied)  # different weights until loaded
    state = restored.load(path)

    assert state == {"step": 2, "cursor": {"0": {"epoch": 1, "position": 3}}}
    assert_same_weights(original.model, restored.model)
    assert_same(original.optimizer.state_dict(), restored.optimizer.state_dict())
    assert isinstance(restored.optimizer.state_dict()["state"][0]["step"], torch.Tensor)
    assert restored.scheduler.get_last_lr() == original.scheduler.get_last_lr()
    assert restored.scheduler.state_dict() == original.scheduler.state_dict()

    original.step()
    restored.step()
    assert_same_weights(original.model, restored.model)


def test_nested_and_python_number_optimizer_state_round_trips(tmp_path: Path, tokenizer):
    # LBFGS keeps python numbers (n_iter, prev_loss) and lists of tensors (old_dirs) in its state.
    model = tiny_model(0)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, history_size=3, max_iter=4)

    def closure():
        optimizer.zero_grad()
        loss = model(input_ids=BATCH, labels=BATCH).loss
        loss.backward()
        return loss

    optimizer.step(closure)
    path = save_checkpoint(
        tmp_path,
        1,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=None,
        trainer_state={},
        keep_last=1,
    )
    restored = torch.optim.LBFGS(tiny_model(1).parameters(), lr=0.5)
    load_checkpoint(path, model=tiny_model(1), optimizer=restored, scheduler=None)
    assert isinstance(optimizer.state_dict()["state"][0]["n_iter"], int)
    assert_same(optimizer.state_dict(), restored.state_dict())


def test_rng_states_are_restored(tmp_path: Path, tokenizer):
    training = Training(seed=0)
    path = training.save(tmp_path, 1, tokenizer)
    expected = (torch.rand(4), np.random.rand(4), random.random())
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)

    training.load(path)

    got = (torch.rand(4), np.random.rand(4), random.random())
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1])
    assert got[2] == expected[2]


def test_saved_model_loads_with_from_pretrained(tmp_path: Path, tokenizer):
    training = Training(seed=0, tied=True)
    training.step()
    path = training.save(tmp_path, 1, tokenizer)
    loaded = LlamaForCausalLM.from_pretrained(path / "model")
    assert_same_weights(training.model, loaded)
    assert PreTrainedTokenizerFast.from_pretrained(path / "model")("w3 w4").input_ids == [3, 4]


def test_the_saved_config_names_the_models_class(artifact_root, tokenizer, as_root):
    """Loaders read config.json's architectures (a reward model's check does): the checkpoint's
    model/ says LlamaForCausalLM, wherever it is saved."""
    import fsspec

    root = as_root(artifact_root)
    path = Training(seed=0).save(root, 1, tokenizer)
    with fsspec.open(f"{path}/model/config.json", "r") as handle:
        assert json.load(handle)["architectures"] == ["LlamaForCausalLM"]


def test_no_file_in_a_checkpoint_is_a_pickle(tmp_path: Path, tokenizer):
    path = Training(seed=0).save(tmp_path, 1, tokenizer)
    files = [file for file in path.rglob("*") if file.is_file()]
    assert {file.name for file in files} >= {MANIFEST, "optimizer.safetensors", "trainer.json"}
    for file in files:
        assert file.suffix in {".json", ".safetensors"} or file.name in {
            MANIFEST,
            *TOKENIZER_FILES,
        }, file
        head = file.read_bytes()[:4]
        # Pickle protocols 2-5 start with 0x80 and the protocol; torch.save writes a zip.
        assert not (head[:1] == b"\x80" and head[1:2] in b"\x02\x03\x04\x05"), file
        assert not head.startswith(b"PK\x03\x04"), file


def test_a_crash_mid_save_keeps_the_previous_checkpoint(tmp_path: Path, tokenizer, monkeypatch):
    training = Training(seed=0)
    first = training.save(tmp_path, 1, tokenizer)

    def disk_full(directory: Path) -> None:
        raise OSError("No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "_save_rng", disk_full)
        with pytest.raises(
            CheckpointError, match=r"No space left.*newest good checkpoint is step 1"
        ):
            training.save(tmp_path, 2, tokenizer)

    assert latest_checkpoint(tmp_path) == first
    # What was staged is gone; a crash (no chance to clean up) would leave a temp directory,
    # which the next save deletes.
    assert [entry.name for entry in tmp_path.iterdir()] == ["step-000001"]
    (tmp_path / ".step-000002.tmp-crashed").mkdir()

    # The next save cleans the leftovers up.
    second = training.save(tmp_path, 2, tokenizer)
    assert latest_checkpoint(tmp_path) == second
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["step-000001", "step-000002"]


def test_a_directory_without_the_marker_is_not_a_checkpoint(tmp_path: Path, tokenizer):
    first = Training(seed=0).save(tmp_path, 1, tokenizer)
    (tmp_path / "step-000009").mkdir()
    assert latest_checkpoint(tmp_path) == first
    with pytest.raises(
        CheckpointError, match=r"no manifest\.json.*newest good checkpoint is step 1"
    ):
        Training(seed=0).load(tmp_path / "step-000009")


def test_keep_last_prunes_the_oldest(tmp_path: Path, tokenizer):
    training = Training(seed=0)
    for step in range(1, 6):
        training.save(tmp_path, step * 10, tokenizer, keep_last=2)
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["step-000040", "step-000050"]
    prune(tmp_path, 1)
    assert [entry.name for entry in tmp_path.iterdir()] == ["step-000050"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000050"


def test_saving_an_existing_step_replaces_it(tmp_path: Path, tokenizer):
    training = Training(seed=0)
    training.save(tmp_path, 3, tokenizer, note="first")
    path = training.save(tmp_path, 3, tokenizer, note="second")
    assert [entry.name for entry in tmp_path.iterdir()] == ["step-000003"]
    assert Training(seed=1).load(path)["note"] == "second"


def test_latest_of_a_missing_root_is_none(tmp_path: Path):
    assert latest_checkpoint(tmp_path / "nothing-here") is None


def test_a_trainer_state_that_is_not_json_fails_before_writing(tmp_path: Path, tokenizer):
    with pytest.raises(TypeError, match="not JSON serializable"):
        Training(seed=0).save(tmp_path, 1, tokenizer, cursor=object())
    assert not tmp_path.joinpath("step-000001").exists()


def test_without_optimizer_state(tmp_path: Path, tokenizer):
    original = Training(seed=0)
    original.step()
    path = save_checkpoint(
        tmp_path,
        1,
        model=original.model,
        tokenizer=tokenizer,
        optimizer=None,
        scheduler=None,
        trainer_state={"step": 1},
        keep_last=1,
    )
    assert not (path / "optimizer.safetensors").exists()
    with pytest.raises(ValueError, match="pass optimizer=None"):
        Training(seed=1).load(path)
    fresh = Training(seed=1)
    load_checkpoint(path, model=fresh.model, optimizer=None, scheduler=None)
    assert_same_weights(original.model, fresh.model)


def test_weights_of_another_architecture_are_refused(tmp_path: Path, tokenizer):
    path = Training(seed=0).save(tmp_path, 1, tokenizer)
    other = tiny_model(0)
    other.model.layers = other.model.layers[:1]
    with pytest.raises(ValueError, match=r"unexpected \['model\.layers\.1\."):
        load_checkpoint(path, model=other, optimizer=None, scheduler=None)


def test_a_critic_saved_beside_the_policy_round_trips(tmp_path: Path, tokenizer):
    from rollout.runtime.checkpoint import Extra
    from rollout.runtime.online.critic import value_model_for

    policy = tiny_model(0)
    critic = value_model_for(policy, separate=True)
    torch.nn.init.normal_(critic.head.weight)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    critic.head(torch.ones(1, 32)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    path = save_checkpoint(
        tmp_path,
        1,
        model=policy,
        tokenizer=tokenizer,
        optimizer=None,
        scheduler=None,
        trainer_state={},
        keep_last=1,
        extras={"critic": Extra(critic, optimizer, scheduler)},
    )
    assert path == tmp_path / "step-000001" and latest_checkpoint(tmp_path) == path
    fresh = value_model_for(tiny_model(1), separate=True)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_checkpoint(
        path,
        model=tiny_model(1),
        optimizer=None,
        scheduler=None,
        extras={"critic": Extra(fresh, fresh_optimizer)},
    )
    for (name, saved), loaded in zip(
        critic.state_dict().items(), fresh.state_dict().values(), strict=True
    ):
        assert torch.equal(saved, loaded), name
    # saved without optimizer state (optimizer=None): the critic's optimizer stays fresh too
    assert not fresh_optimizer.state


def test_rng_state_as_json_round_trips():
    import json

    from rollout.runtime.checkpoint import rng_state, set_rng_state

    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    saved = json.loads(json.dumps(rng_state()))  # what travels in the trainer state
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    set_rng_state(saved)
    drawn = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], expected[0])
    assert np.array_equal(drawn[1], expected[1])
    assert drawn[2] == expected[2]


# --- A run's state across ranks (rollout.runtime.run_state) --------------------------------------


class Writer:
    """Stands in for the run store's background writer: what reached it, in order."""

    def __init__(self):
        self.checkpoints: list[int] = []
        self.metrics: dict[int, dict[str, float]] = {}

    def flush(self) -> None:
        pass

    def write_checkpoint(self, run_id: str, step: int, location: str) -> None:
        self.checkpoints.append(step)

    def write_metrics(self, run_id: str, step: int, values) -> None:
        self.metrics.setdefault(step, {}).update(values)


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan():
    """A real plan (the repository's plan.lock.example: tiny GRPO, one rank)."""
    from rollout.planner.lockfile import read_plan

    return read_plan(REPO / "plan.lock.example", check_fresh=False)


def rank_context(rank: int, world: int, plan, *, keep_last: int = 2):
    from types import SimpleNamespace

    from rollout.runtime.uploads import Uploads

    checkpoint_section = plan.config.checkpoint.model_copy(update={"keep_last": keep_last})
    config = plan.config.model_copy(update={"checkpoint": checkpoint_section})
    return SimpleNamespace(
        rank=rank,
        world_size=world,
        is_main=rank == 0,
        learners=world,  # colocated: every rank learns
        seed_index=rank,
        plan=plan.model_copy(update={"config": config}),
        uploads=Uploads(),
    )


def run_state(root: Path, tokenizer, rank: int, *, seed: int = 0):
    from rollout.runtime.data import PromptStream
    from rollout.runtime.run_state import RunState

    training = Training(seed=seed)
    records = [{"i": i} for i in range(10)]
    stream = PromptStream(records, seed=7, shuffle=True, rank=rank, world_size=2)
    return RunState(root, training.model, tokenizer, training.optimizer, training.scheduler, stream)


def test_every_rank_resumes_its_cursor_and_its_own_rng(
    tmp_path: Path, tokenizer, plan, monkeypatch
):
    """Rank 0 saves for two ranks (the gathers stand in for the collectives); each rank then
    resumes its own data cursor and draws what it would have drawn had the run gone on."""
    import json

    from rollout.runtime import run_state as module
    from rollout.runtime.checkpoint import rng_state

    ranks = [run_state(tmp_path, tokenizer, rank) for rank in (0, 1)]
    for state in ranks:
        state.stream.take(3)
    torch.manual_seed(11)  # rank 1's generator as it stands at the checkpoint
    rank1_rng = json.loads(json.dumps(rng_state()))
    rank1_draws = torch.rand(3)
    monkeypatch.setattr(
        module, "gather_by_rank", lambda ctx, value: {"0": value, "1": ranks[1].stream.state_dict()}
    )
    monkeypatch.setattr(module, "gather_rng", lambda ctx: {"1": rank1_rng})
    monkeypatch.setattr(module.transport.dist, "barrier", lambda group=None: None)
    torch.manual_seed(10)  # rank 0's
    writer = Writer()
    ranks[0].save(rank_context(0, 2, plan), writer, 4, {"policy_version": 4})
    rank0_draws = torch.rand(3)
    assert writer.checkpoints == [4]

    for rank, draws in ((0, rank0_draws), (1, rank1_draws)):
        resumed = run_state(tmp_path, tokenizer, rank, seed=1)
        torch.manual_seed(99)  # what a restarted worker seeds before resuming
        state = resumed.resume(rank_context(rank, 2, plan))
        assert state["step"] == 4 and state["policy_version"] == 4
        assert torch.equal(torch.rand(3), draws), rank
        assert resumed.stream.take(2) == ranks[rank].stream.take(2)
        assert_same_weights(resumed.model, ranks[0].model)


def test_a_fresh_run_has_nothing_to_resume(tmp_path: Path, tokenizer, plan):
    assert (
        run_state(tmp_path / "checkpoints", tokenizer, 0).resume(rank_context(0, 2, plan)) is None
    )


# --- Committed by manifest, on every kind of root (local, S3 and GCS over the wire) --------------


def _fs(location: str):
    import fsspec

    return fsspec.core.url_to_fs(location)


def _read(location: str | Path, name: str) -> bytes:
    if isinstance(location, Path):
        return (location / name).read_bytes()
    fs, path = _fs(location)
    return fs.cat_file(f"{path}/{name}")


def _write(location: str | Path, name: str, data: bytes) -> None:
    if isinstance(location, Path):
        (location / name).write_bytes(data)
    else:
        fs, path = _fs(location)
        fs.pipe_file(f"{path}/{name}", data)


def _remove(location: str | Path, name: str) -> None:
    if isinstance(location, Path):
        (location / name).unlink()
    else:
        fs, path = _fs(location)
        fs.rm_file(f"{path}/{name}")


def _flip_a_byte(location: str | Path, name: str) -> None:
    data = bytearray(_read(location, name))
    data[len(data) // 2] ^= 0xFF
    _write(location, name, bytes(data))


def test_a_checkpoint_is_committed_by_its_manifest(artifact_root, tokenizer):
    import hashlib

    from rollout.runtime.manifest import problems, read_manifest

    training = Training(seed=0)
    training.step()
    saved = save_checkpoint(
        artifact_root,
        2,
        model=training.model,
        tokenizer=tokenizer,
        optimizer=training.optimizer,
        scheduler=training.scheduler,
        trainer_state={"step": 2},
        keep_last=2,
        run_id="run-a",
        plan="f" * 64,
    )
    manifest = read_manifest(saved)
    assert (manifest["step"], manifest["run_id"], manifest["plan"]) == (2, "run-a", "f" * 64)
    assert {"model/model.safetensors", "optimizer.safetensors", "trainer.json"} <= set(
        manifest["files"]
    )
    assert MANIFEST not in manifest["files"]
    for name, entry in manifest["files"].items():
        data = _read(saved, name)
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert problems(saved) == []
    restored = Training(seed=5)
    assert restored.load(saved) == {"step": 2}
    assert_same_weights(restored.model, training.model)


def test_a_loop_directory_is_committed_and_read_back_checked(artifact_root, tokenizer):
    """What a loop writes itself (a disaggregated learner's buffer/) is in the manifest like any
    file, read back from the checked copy, and refused when damaged."""
    from rollout.runtime.checkpoint import commit_checkpoint, stage_checkpoint
    from rollout.runtime.manifest import problems, read_manifest

    training = Training(seed=0)

    def write(directory: Path) -> None:
        (directory / "notes.json").write_text('{"held": [3, 4]}', encoding="utf-8")

    staged = stage_checkpoint(
        artifact_root,
        2,
        model=training.model,
        tokenizer=tokenizer,
        optimizer=training.optimizer,
        scheduler=training.scheduler,
        trainer_state={"step": 2},
        loop_files={"buffer": write},
    )
    saved = commit_checkpoint(staged)
    assert "buffer/notes.json" in read_manifest(saved)["files"]
    assert problems(saved) == []

    read: list[tuple[bool, str]] = []

    def reader(directory: Path) -> None:
        notes = directory / "notes.json"
        read.append((Path(directory).is_dir(), notes.read_text() if notes.is_file() else ""))

    files = {"buffer": reader, "absent": reader}
    load_checkpoint(saved, model=training.model, optimizer=None, scheduler=None, loop_files=files)
    assert read == [(True, '{"held": [3, 4]}'), (False, "")]

    _flip_a_byte(saved, "buffer/notes.json")
    with pytest.raises(CheckpointError, match=r"buffer/notes\.json does not match its sha256"):
        load_checkpoint(
            saved, model=training.model, optimizer=None, scheduler=None, loop_files=files
        )
    assert len(read) == 2  # refused before any reader ran


def test_a_damaged_checkpoint_is_never_loaded_and_the_error_names_the_good_one(
    artifact_root, tokenizer
):
    from rollout.runtime.manifest import inventory

    training = Training(seed=0)
    first = training.save(artifact_root, 1, tokenizer)
    training.step()
    second = training.save(artifact_root, 2, tokenizer)
    third = training.save(artifact_root, 3, tokenizer)
    _flip_a_byte(second, "optimizer.safetensors")  # corrupted: same size, other bytes
    data = _read(third, "model/model.safetensors")
    _write(third, "model/model.safetensors", data[: len(data) // 2])  # truncated

    fresh = Training(seed=9)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(CheckpointError) as corrupted:
        fresh.load(second)
    assert "optimizer.safetensors does not match its sha256" in str(corrupted.value)
    assert f"newest good checkpoint is step 1: {first}" in str(corrupted.value)
    with pytest.raises(
        CheckpointError, match=r"model/model.safetensors has .* bytes; its manifest"
    ):
        fresh.load(third)
    for key, value in fresh.model.state_dict().items():  # refused before anything was restored
        assert torch.equal(value, before[key]), key

    states = {found.step: found.state for found in inventory(artifact_root, hashes=True)}
    assert states == {1: "committed", 2: "damaged", 3: "damaged"}
    # Sizes only (what listing and latest_checkpoint check): the flipped byte needs the hashes.
    assert latest_checkpoint(artifact_root) == second


def test_without_its_manifest_a_checkpoint_is_uncommitted(artifact_root, tokenizer):
    from rollout.runtime.manifest import inventory

    training = Training(seed=0)
    first = training.save(artifact_root, 1, tokenizer)
    second = training.save(artifact_root, 2, tokenizer)
    _remove(second, MANIFEST)  # an upload cut short before its manifest
    assert latest_checkpoint(artifact_root) == first
    assert [f.state for f in inventory(artifact_root)] == ["committed", "uncommitted"]
    with pytest.raises(CheckpointError, match=f"no {MANIFEST}.*step 1"):
        Training(seed=1).load(second)
    # The next save of that step replaces what was left of it.
    assert training.save(artifact_root, 2, tokenizer) == second
    assert latest_checkpoint(artifact_root) == second


def test_retention_counts_only_committed_checkpoints(artifact_root, tokenizer):
    from rollout.runtime.manifest import inventory

    training = Training(seed=0)
    for step in (1, 2, 3):
        training.save(artifact_root, step, tokenizer, keep_last=2)
    assert [f.step for f in inventory(artifact_root)] == [2, 3]
    _remove(checkpoint_at(artifact_root, 3), MANIFEST)
    # Step 3 is not committed: it does not count, so step 2 survives step 4's save.
    training.save(artifact_root, 4, tokenizer, keep_last=2)
    assert [(f.step, f.state) for f in inventory(artifact_root)] == [
        (2, "committed"),
        (4, "committed"),
    ]


def checkpoint_at(root: str | Path, step: int) -> str | Path:
    name = f"step-{step:06d}"
    return f"{root}/{name}" if "://" in str(root) else Path(root) / name


@pytest.fixture
def as_root():
    """Paths as the checkpoint module gives them back: Path under a local root, URL otherwise."""
    return lambda root: root if "://" in str(root) else Path(root)


# --- Resuming: the newest good checkpoint, never another plan's ---------------------------------


def _resumable(root, tokenizer, *, seed: int = 0):
    from rollout.runtime.data import PromptStream
    from rollout.runtime.run_state import RunState

    training = Training(seed=seed)
    stream = PromptStream([{"i": i} for i in range(10)], seed=7, shuffle=True)
    state = RunState(
        root, training.model, tokenizer, training.optimizer, training.scheduler, stream
    )
    return training, state


def test_resume_skips_damaged_newer_checkpoints_with_a_warning(
    artifact_root, tokenizer, plan, as_root, caplog
):
    root = as_root(artifact_root)
    training, state = _resumable(root, tokenizer)
    ctx = rank_context(0, 1, plan, keep_last=5)
    writer = Writer()
    for step in (1, 2, 3):
        training.step()
        state.stream.take(2)
        state.save(ctx, writer, step)
        if step == 1:
            weights_at_1 = {k: v.clone() for k, v in training.model.state_dict().items()}
    ctx.uploads.wait()
    assert writer.checkpoints == [1, 2, 3]
    _flip_a_byte(checkpoint_at(root, 3), "model/model.safetensors")
    _remove(checkpoint_at(root, 2), MANIFEST)

    resumed_training, resumed = _resumable(root, tokenizer, seed=4)
    with caplog.at_level("WARNING", logger="rollout.checkpoint"):
        saved = resumed.resume(rank_context(0, 1, plan))
    assert saved["step"] == 1
    for key, value in resumed_training.model.state_dict().items():
        assert torch.equal(value, weights_at_1[key]), key
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("step-000003" in w and "does not match its sha256" in w for w in warnings)
    assert any("step-000002" in w and f"no {MANIFEST}" in w for w in warnings)


def test_a_checkpoint_of_another_plan_is_refused(artifact_root, tokenizer, plan, as_root):
    root = as_root(artifact_root)
    _, state = _resumable(root, tokenizer)
    ctx = rank_context(0, 1, plan)
    state.save(ctx, Writer(), 1)
    ctx.uploads.wait()

    # Another model (a fingerprint of other weights): resuming would train something else on.
    other_model = plan.model.model_copy(update={"fingerprint": "0" * 64})
    other = plan.model_copy(update={"model": other_model, "run_id": "other-run"})
    with pytest.raises(CheckpointError) as refused:
        _resumable(root, tokenizer)[1].resume(rank_context(0, 1, other))
    message = str(refused.value)
    assert "saved by another plan" in message and plan.run_id in message
    assert "other-run" in message and "storage.artifacts" in message

    # A harmless re-plan (new run id, more steps, another learning rate) resumes.
    algorithm = plan.config.algorithm.model_copy(update={"max_steps": 99, "lr": 1e-3})
    replanned = plan.model_copy(
        update={
            "run_id": "replanned",
            "created_at": "2027-01-01T00:00:00Z",
            "config": plan.config.model_copy(update={"algorithm": algorithm}),
        }
    )
    assert _resumable(root, tokenizer)[1].resume(rank_context(0, 1, replanned))["step"] == 1


# --- Uploads off the critical path --------------------------------------------------------------


def test_an_object_store_checkpoint_is_committed_by_an_upload_thread(
    s3_bucket, tokenizer, plan, monkeypatch
):
    """The save returns once staged; parts, then the manifest, then retention, then the store's
    record follow on the upload thread; the next save waits for it (one upload in flight)."""
    import threading

    from rollout.runtime import run_state as module
    from rollout.runtime.manifest import inventory

    root = f"{s3_bucket}/ckpt"
    training, state = _resumable(root, tokenizer)
    ctx = rank_context(0, 1, plan, keep_last=1)
    writer = Writer()
    release = threading.Event()
    commit = module.commit_checkpoint

    def held_commit(staged):  # the upload waits until the test has looked
        release.wait(30)
        return commit(staged)

    monkeypatch.setattr(module, "commit_checkpoint", held_commit)
    state.save(ctx, writer, 1)
    assert ctx.uploads.in_flight  # the next save would wait for it: one upload in flight
    assert writer.checkpoints == []  # not committed: not recorded
    assert latest_checkpoint(root) is None
    assert writer.metrics[1]["perf/checkpoint_blocking_s"] > 0
    # Training goes on while step 1 uploads: the checkpoint holds the weights of step 1.
    at_step_1 = {k: v.clone() for k, v in training.model.state_dict().items()}
    training.step()
    release.set()
    ctx.uploads.wait()
    restored = Training(seed=3)
    restored.load(f"{root}/step-000001")
    for key, value in restored.model.state_dict().items():
        assert torch.equal(value, at_step_1[key]), key
    state.save(ctx, writer, 2)
    ctx.uploads.wait()
    assert writer.checkpoints == [1, 2]
    assert writer.metrics[2]["perf/checkpoint_commit_s"] > 0
    assert [(f.step, f.state) for f in inventory(root)] == [(2, "committed")]


def test_saves_to_an_object_store_reuse_their_copy_buffers(s3_bucket, tokenizer, plan):
    """The second save copies into the first save's memory, and still holds its own step's
    weights and optimizer state (the first upload ended before the second save copied)."""
    root = f"{s3_bucket}/ckpt"
    training, state = _resumable(root, tokenizer)
    ctx = rank_context(0, 1, plan, keep_last=2)
    writer = Writer()
    training.step()
    state.save(ctx, writer, 1)
    ctx.uploads.wait()
    first = {key: buffer.data_ptr() for key, buffer in state.buffers._buffers.items()}
    assert any(key.startswith("optimizer.safetensors:") for key in first)
    training.step()
    expected = Training(seed=9)
    expected.model.load_state_dict(training.model.state_dict())
    expected.optimizer.load_state_dict(training.optimizer.state_dict())
    state.save(ctx, writer, 2)
    ctx.uploads.wait()
    assert {key: b.data_ptr() for key, b in state.buffers._buffers.items()} == first
    restored = Training(seed=3)
    restored.load(f"{root}/step-000002")
    assert_same_weights(restored.model, expected.model)
    assert_same(restored.optimizer.state_dict(), expected.optimizer.state_dict())


def test_a_bucket_gone_mid_upload_fails_the_save_clearly(s3_bucket, tokenizer, plan):
    import fsspec

    from rollout.runtime.checkpoint import commit_checkpoint, stage_checkpoint

    root = f"{s3_bucket}/ckpt"
    training, state = _resumable(root, tokenizer)
    ctx = rank_context(0, 1, plan)
    writer = Writer()
    state.save(ctx, writer, 1)
    ctx.uploads.wait()
    staged = stage_checkpoint(
        root,
        2,
        model=training.model,
        tokenizer=tokenizer,
        optimizer=None,
        scheduler=None,
        trainer_state={},
    )
    fs = fsspec.filesystem("s3")
    fs.rm(s3_bucket.removeprefix("s3://"), recursive=True)  # the bucket, deleted
    with pytest.raises(CheckpointError) as failed:
        commit_checkpoint(staged)
    assert f"checkpoint step 2 was not saved under {root}: committing it failed" in str(
        failed.value
    )
    assert not staged.directory.exists()  # nothing staged is left behind


def test_a_failed_upload_is_raised_at_the_next_save_and_logged_at_once(
    s3_bucket, tokenizer, plan, caplog
):
    import fsspec

    root = f"{s3_bucket}/ckpt"
    _, state = _resumable(root, tokenizer)
    ctx = rank_context(0, 1, plan)
    writer = Writer()
    fsspec.filesystem("s3").rm(s3_bucket.removeprefix("s3://"), recursive=True)
    with caplog.at_level("ERROR", logger="rollout.checkpoint"):
        state.save(ctx, writer, 1)  # staged fine; the upload fails on its thread
        while ctx.uploads.in_flight:
            time.sleep(0.05)
    assert any("upload of checkpoint step 1 failed" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointError, match="checkpoint step 1 was not saved"):
        state.save(ctx, writer, 2)
    assert writer.checkpoints == []


# --- A full disk -------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 2 MiB tmpfs (skips where mounting is not permitted); always unmounted."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(small_disk, tokenizer):
    from rollout.runtime.manifest import inventory, problems

    root = small_disk / "checkpoints"
    training = Training(seed=0)
    first = training.save(root, 1, tokenizer)
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    (small_disk / "filler").write_bytes(b"\0" * (free - 64 * 1024))  # leave 64 KiB
    training.step()
    with pytest.raises(CheckpointError) as full:
        training.save(root, 2, tokenizer)
    message = str(full.value)
    assert "checkpoint step 2 was not saved" in message and "No space left" in message
    assert f"newest good checkpoint is step 1: {first}" in message
    assert [f.step for f in inventory(root)] == [1] and problems(first) == []
    assert [entry.name for entry in root.iterdir()] == ["step-000001"]  # nothing half-written
    Training(seed=3).load(first)
