"""Checkpoints: one directory per step, published atomically, holding no pickle.

    <root>/step-000010/
        model/                  save_pretrained output: config, safetensors weights, tokenizer
        optimizer.safetensors   the optimizer's tensors, keyed state.{param_index}.{name}
        optimizer.json          the rest of its state_dict (param_groups, python-number state)
        scheduler.json          the lr scheduler's state_dict (plain data)
        rng.safetensors         torch CPU and CUDA generator states, numpy's MT19937 key
        rng.json                the rest of numpy's state, python `random`'s state
        trainer.json            format version, step, and the trainer's own JSON-able state
        <extra>/                a module trained beside the policy (PPO's critic): its
                                weights.safetensors, and its optimizer and scheduler files
        <loop file>/            a directory the training loop writes itself (a disaggregated
                                learner's batches sampled ahead: buffer/,
                                rollout.runtime.online.pending)
        manifest.json           written last, on every backend: every other file's size and
                                sha256, the step, the run id and the plan's fingerprint
                                (rollout.runtime.manifest). It commits the checkpoint: one
                                without it, or whose files do not match it, is never loaded

With LoRA ([model.lora]) the base model never changes, so a checkpoint holds the adapter instead
of model/, and the optimizer state is the adapter's (the only parameters it steps):

        adapter/                peft's adapter_config.json and adapter_model.safetensors, and
                                the tokenizer: PeftModel.from_pretrained(base, "adapter") loads it
        model/                  only with model.lora.export = "merged": a plain Hugging Face
                                model with the adapters merged in (what generate and serve load)

A save has two halves. `stage_checkpoint` writes every file into a local directory (the part a
training step waits for); `commit_checkpoint` hashes them into the manifest and publishes. Under
a local root the staging directory is `<root>/.step-000010.tmp-<random>`: committing fsyncs it,
writes the manifest, renames it to `step-000010` and fsyncs `<root>`. A crash at any point leaves
either the finished checkpoint or a temp directory, which readers ignore and the next save
deletes.

A sharded learner (cluster.sharding = "fsdp", rollout.runtime.sharding) writes the same files:
every rank helps gather the full weights and optimizer state to rank 0 (`FullState`), which
writes them as a replicated run would; loading, rank 0 reads them and sends each rank its shard
(rollout.runtime.sharding.ShardedLoader).

Only tensors go to safetensors and everything else to JSON, so reading a checkpoint never unpickles
anything. One process (rank 0) writes to a root at a time. The RNG states are that process's own.

`root` is a local directory or an fsspec URL (`s3://bucket/prefix`, `gs://bucket/prefix`:
storage.artifacts). A remote checkpoint is staged in a local temporary directory, its large
tensor files (weights, optimizer state) as copies in memory that committing writes there: a
memory copy is what the training step waits for, not the disk. Committing then uploads the
files, then the manifest (an object store has no atomic rename: a checkpoint without
its manifest is ignored, and its step is replaced by the next save of it). Committing may run on
another thread while training goes on (rollout.runtime.uploads). Loading a remote checkpoint
downloads it to a local temporary directory first; every load checks each file against the
manifest's sha256 before reading a byte of it. Every operation on directories (staging,
publishing, deleting) lives in the section at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from rollout.files import is_url
from rollout.runtime.manifest import (
    MANIFEST,
    STEP_DIR,
    build_manifest,
    filesystem,
    inventory,
    manifest_bytes,
    manifest_problems,
    newest_committed,
    read_manifest,
)

if TYPE_CHECKING:
    from rollout.models.lora import Adapters

FORMAT_VERSION = 1
ADAPTER_DIR = "adapter"

LoopFiles = Mapping[str, Callable[[Path], None]]
"""Directories of a checkpoint that the training loop writes and reads itself, by name: when
saving, each function is given the fresh staged directory to write into; when loading, the
directory in the checked local copy (which may not exist: an older checkpoint, or a save that
had nothing to put there)."""

_TEMP_DIR = re.compile(r"\.step-\d+\.tmp-.+")
# Tags that let JSON carry what it has no type for: a tensor stored in the .safetensors file
# beside it, and a tuple (AdamW's betas) that must come back as a tuple.
_TENSOR = "__tensor__"
_TUPLE = "__tuple__"


@dataclass(frozen=True)
class Extra:
    """A module trained beside the policy (PPO's critic or value head), saved under a name of
    its own; optimizer and scheduler are None when it has none of its own."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None


@dataclass(frozen=True)
class FullState:
    """A sharded model's state gathered whole for saving (rollout.runtime.sharding): its weights
    by name (each tied tensor once), and its optimizer's state_dict keyed by parameter index, as
    Optimizer.state_dict() has it (None: not saved)."""

    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None


class FullStateLoader(Protocol):
    """Restores a sharded model from full state that one rank reads (rollout.runtime.sharding);
    every rank calls `weights` and, when the optimizer is restored, `optimizer_state`."""

    reads: bool
    """Whether this rank reads the files; the others pass empty state and are sent theirs."""

    def weights(self, saved: dict[str, torch.Tensor]) -> None: ...

    def optimizer_state(self, state_dict: dict[str, Any]) -> None: ...


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded (never committed, damaged, another plan's), or a
    save that could not be committed; the message says which, and what is usable instead."""


@dataclass(frozen=True)
class Staged:
    """A checkpoint written to a local directory, not yet committed (no manifest)."""

    directory: Path
    root: str | Path
    step: int
    run_id: str
    plan: str
    """The plan's fingerprint (rollout.runtime.manifest.plan_fingerprint)."""
    deferred: list[tuple[Path, dict[str, torch.Tensor], dict[str, str] | None]] = field(
        default_factory=list
    )
    """Tensor files still to write (path, copies of the tensors, metadata): under an object-store
    root the large files are written by commit_checkpoint, on the upload thread."""

    @property
    def name(self) -> str:
        return f"step-{self.step:06d}"


class CopyBuffers:
    """The CPU tensors staging copies a checkpoint's large tensors into, kept from one save to
    the next: copying into memory already touched is about twice as fast as into fresh pages,
    and the copy is what a training step waits for. The price is one CPU copy of the weights
    and optimizer state held for the run's life. Pinned when the tensors are on a GPU, so the
    copy runs at full transfer speed.

    A buffer is reused only once the commit that wrote it has ended: the caller stages a save
    after the previous upload has finished (rollout.runtime.uploads allows one in flight)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = tensor.is_cuda and torch.cuda.is_available()
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buffer
        buffer.copy_(tensor.detach())
        return buffer


@dataclass
class _Deferred:
    """Where staging puts tensor files that the commit writes: copies in `buffers`, listed in
    `files` (the Staged's own list)."""

    staging: Path
    buffers: CopyBuffers
    files: list[tuple[Path, dict[str, torch.Tensor], dict[str, str] | None]]

    def add(
        self, path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None
    ) -> None:
        file = path.relative_to(self.staging).as_posix()  # the same key from save to save
        copies = {name: self.buffers.copy(f"{file}:{name}", t) for name, t in tensors.items()}
        self.files.append((path, copies, metadata))


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    trainer_state: dict[str, Any],
    keep_last: int,
    extras: Mapping[str, Extra] | None = None,
    adapters: Adapters | None = None,
    run_id: str = "",
    plan: str = "",
) -> Path | str:
    """Save and commit a checkpoint of `step` under `root`, then keep only the `keep_last` newest
    committed ones: `stage_checkpoint`, `commit_checkpoint` and `prune` in one call."""
    if keep_last < 1:
        raise ValueError(f"need keep_last >= 1, got {keep_last}")
    staged = stage_checkpoint(
        root,
        step,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state=trainer_state,
        extras=extras,
        adapters=adapters,
        run_id=run_id,
        plan=plan,
    )
    final = commit_checkpoint(staged)
    prune(root, keep_last)
    return final


def stage_checkpoint(
    root: str | Path,
    step: int,
    *,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    trainer_state: dict[str, Any],
    extras: Mapping[str, Extra] | None = None,
    adapters: Adapters | None = None,
    run_id: str = "",
    plan: str = "",
    buffers: CopyBuffers | None = None,
    full_state: FullState | None = None,
    loop_files: LoopFiles | None = None,
) -> Staged:
    """Write a checkpoint of `step` into a local staging directory: everything the training
    state is read for, so the model may change as soon as this returns.

    `model` is a transformers PreTrainedModel and `tokenizer` its tokenizer. The optimizer and
    scheduler may be None (checkpoint.save_optimizer = false). With LoRA `adapters`, the adapter
    is saved instead of the model, and the merged model beside it where their export says so.
    Saving a step that already exists replaces it when committed. A failure (a full disk)
    removes what was staged and leaves every committed checkpoint as it was. Under an
    object-store root the large tensors are copied into `buffers` (a fresh set when None). A
    sharded model's weights and optimizer state come gathered in `full_state`
    (rollout.runtime.sharding). Each of `loop_files` writes its own directory (small files,
    written now under any root).
    """
    if step < 0:
        raise ValueError(f"need step >= 0, got step={step}")
    # Serialize first: a trainer state that is not JSON fails before anything is written.
    trainer_json = _dumps(
        {"format_version": FORMAT_VERSION, "step": step, "trainer_state": trainer_state}
    )
    staged = Staged(_stage(root, f"step-{step:06d}"), root, step, run_id, plan)
    # Under an object-store root the commit runs beside training: the large tensor files are
    # copied in memory now (what the step waits for) and written by the commit.
    deferred = None
    if is_url(root):
        deferred = _Deferred(staged.directory, buffers or CopyBuffers(), staged.deferred)
    try:
        _write_state(
            staged.directory,
            model,
            tokenizer,
            optimizer,
            scheduler,
            extras,
            adapters,
            deferred,
            full_state,
        )
        for name, write in (loop_files or {}).items():
            (staged.directory / name).mkdir()
            write(staged.directory / name)
        (staged.directory / "trainer.json").write_text(trainer_json, encoding="utf-8")
    except BaseException as error:
        shutil.rmtree(staged.directory, ignore_errors=True)
        if isinstance(error, OSError | SafetensorError):  # safetensors' own for a full disk
            raise CheckpointError(_not_saved(staged, f"writing it failed: {error}")) from error
        raise
    return staged


def _write_state(
    staging: Path,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    extras: Mapping[str, Extra] | None,
    adapters: Adapters | None,
    deferred: _Deferred | None,
    full_state: FullState | None = None,
) -> None:
    if full_state is not None:  # a sharded model: LoRA is refused with sharding
        _save_model_files(staging / "model", model, full_state.weights, deferred)
        tokenizer.save_pretrained(staging / "model")
    elif adapters is None:
        # Not save_pretrained: transformers writes weights on global rank 0 only, and the first
        # learner of a disaggregated run is another rank.
        _save_model(staging / "model", model, deferred)
        tokenizer.save_pretrained(staging / "model")
    else:
        adapters.save(staging / ADAPTER_DIR)
        tokenizer.save_pretrained(staging / ADAPTER_DIR)
    if adapters is not None and adapters.export_merged:
        adapters.save_merged(staging / "model")
        tokenizer.save_pretrained(staging / "model")
    if full_state is not None and full_state.optimizer is not None:
        _save_optimizer_state(staging, full_state.optimizer, deferred)
    elif optimizer is not None:
        _save_optimizer(staging, optimizer, deferred)
    if scheduler is not None:
        _write_json(staging / "scheduler.json", scheduler.state_dict())
    for extra_name, extra in (extras or {}).items():
        _save_extra(staging / extra_name, extra, deferred, with_optimizer=optimizer is not None)
    _save_rng(staging)


def _save_model(directory: Path, model: Any, deferred: _Deferred | None) -> None:
    """What save_pretrained writes: config and generation config now, model.safetensors (each
    tied tensor once, under its first name) now, or with `deferred` as copies the commit
    writes."""
    seen: set[int] = set()
    weights = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            weights[name] = tensor
    _save_model_files(directory, model, weights, deferred)


def _save_model_files(
    directory: Path, model: Any, weights: dict[str, torch.Tensor], deferred: _Deferred | None
) -> None:
    """What save_pretrained writes, with `weights` as the model's: config, generation config
    and model.safetensors (now, or by the commit with `deferred`)."""
    directory.mkdir(parents=True)
    # As save_pretrained does: config.json names the class, which loaders (a reward model's
    # check, AutoModel) read; FSDP2's wrapper class is not the model's.
    model.config.architectures = [_architecture(model)]
    model.config.save_pretrained(directory)
    if model.can_generate():  # as save_pretrained does
        model.generation_config.save_pretrained(directory)
    _save_tensors(directory / "model.safetensors", weights, deferred, {"format": "pt"})


def _architecture(model: Any) -> str:
    """The model's own class name: FSDP2 swaps a sharded module's class for a subclass of it."""
    for cls in type(model).__mro__:
        if not cls.__module__.startswith("torch.distributed"):
            return cls.__name__
    return type(model).__name__


def _save_tensors(
    path: Path,
    tensors: dict[str, torch.Tensor],
    deferred: _Deferred | None,
    metadata: dict[str, str] | None = None,
) -> None:
    """save_file now, or (with `deferred`) a CPU copy of each tensor to write it later."""
    if deferred is None:
        save_file(tensors, path, metadata=metadata)
    else:
        deferred.add(path, tensors, metadata)


def _write_deferred(staged: Staged) -> None:
    while staged.deferred:  # the buffers stay with their CopyBuffers for the next save
        path, tensors, metadata = staged.deferred.pop()
        save_file(tensors, path, metadata=metadata)


def commit_checkpoint(staged: Staged) -> Path | str:
    """Hash the staged files into the manifest and publish the checkpoint under its root, the
    manifest last; return where it is. Safe to run on another thread than the one training.

    On failure (a full disk, a bucket gone) the staged files are removed, the checkpoint stays
    uncommitted, and the error says which committed checkpoint is the newest.
    """
    try:
        _write_deferred(staged)
        manifest = build_manifest(
            staged.directory, step=staged.step, run_id=staged.run_id, plan=staged.plan
        )
        return _publish(staged, manifest_bytes(manifest))
    except (OSError, SafetensorError) as error:
        raise CheckpointError(_not_saved(staged, f"committing it failed: {error}")) from error
    finally:
        staged.deferred.clear()
        shutil.rmtree(staged.directory, ignore_errors=True)


def _not_saved(staged: Staged, why: str) -> str:
    return (
        f"checkpoint step {staged.step} was not saved under {staged.root}: {why}. "
        f"{_newest_good(staged.root, below=None)}"
    )


def _newest_good(root: str | Path, *, below: int | None) -> str:
    """A sentence naming the newest committed checkpoint under `root` (below step `below`)."""
    try:
        found = newest_committed(root, below=below)
    except Exception as error:  # the root itself is gone (a deleted bucket): say that
        return f"The checkpoints under {root} cannot be listed ({error!r})."
    if found is None:
        return f"There is no committed checkpoint under {root}."
    return f"The newest good checkpoint is step {found.step}: {found.location}."


def latest_checkpoint(root: str | Path) -> Path | str | None:
    """The committed checkpoint with the highest step under `root` (a URL when `root` is one),
    or None if there is none. Its files are there at their sizes; loading checks their hashes."""
    found = newest_committed(root)
    return found.location if found else None


def load_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    extras: Mapping[str, Extra] | None = None,
    adapters: Adapters | None = None,
    full_state: FullStateLoader | None = None,
    loop_files: LoopFiles | None = None,
) -> dict[str, Any]:
    """Restore weights (in place, strictly; with LoRA `adapters`, the adapter's), optimizer,
    scheduler and RNG states from a checkpoint; return the trainer state it was saved with. Pass
    None for an optimizer or scheduler that should keep its fresh state. A sharded model's
    weights and optimizer state go through `full_state` (collective: every rank calls this).
    Each of `loop_files` reads its directory, last.

    Every file is checked against the manifest first: a checkpoint that was never committed or
    is damaged raises CheckpointError before anything is restored."""
    with local_copy(path) as local:
        return _load_verified(
            local,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            extras=extras,
            adapters=adapters,
            full_state=full_state,
            loop_files=loop_files,
        )


@contextlib.contextmanager
def local_copy(path: str | Path) -> Iterator[Path]:
    """A checked local copy of checkpoint `path` (itself, when local): CheckpointError naming
    what is wrong and the newest good checkpoint beside it when it is not committed or its files
    do not match its manifest."""
    manifest = read_manifest(path)  # ValueError for one that is not a manifest
    if manifest is None:
        raise CheckpointError(_refusal(path, [f"it has no {MANIFEST} (never committed)"]))
    if not is_url(path):
        _refuse_if_damaged(path, manifest)
        yield Path(path)
        return
    with _downloaded(str(path), manifest) as local:
        _refuse_if_damaged(local, manifest, shown=path)
        yield local


def _refuse_if_damaged(
    local: str | Path, manifest: dict[str, Any], shown: str | Path | None = None
) -> None:
    found = manifest_problems(local, manifest, hashes=True)
    if found:
        raise CheckpointError(_refusal(shown or local, found))


def _refusal(path: str | Path, found: list[str]) -> str:
    parent, step = _parent_and_step(path)
    newest = _newest_good(parent, below=step) if step is not None else ""
    return f"{path} is not a good checkpoint: {'; '.join(found)}. {newest}".rstrip()


def _parent_and_step(path: str | Path) -> tuple[str | Path, int | None]:
    text = str(path).rstrip("/")
    parent, _, name = text.rpartition("/")
    match = STEP_DIR.fullmatch(name)
    step = int(match.group(1)) if match else None
    return (parent if is_url(path) else Path(path).parent), step


def _load_verified(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    extras: Mapping[str, Extra] | None,
    adapters: Adapters | None,
    full_state: FullStateLoader | None = None,
    loop_files: LoopFiles | None = None,
) -> dict[str, Any]:
    trainer = _read_json(path / "trainer.json")
    if trainer["format_version"] != FORMAT_VERSION:
        raise ValueError(
            f"{path} has checkpoint format {trainer['format_version']}; this version of rollout "
            f"reads format {FORMAT_VERSION}"
        )
    if full_state is not None:
        full_state.weights(_read_weights(model, path / "model") if full_state.reads else {})
    elif adapters is None:
        _load_weights(model, path / "model")
    elif not (path / ADAPTER_DIR).is_dir():
        raise ValueError(
            f"{path} holds no {ADAPTER_DIR}/: it was saved without LoRA, and this run trains "
            "LoRA adapters ([model.lora])"
        )
    else:
        adapters.load(path / ADAPTER_DIR)
    if optimizer is not None and full_state is not None:
        full_state.optimizer_state(_read_optimizer(path) if full_state.reads else {})
    elif optimizer is not None:
        _load_optimizer(path, optimizer)
    if scheduler is not None:
        scheduler.load_state_dict(_read_json(_saved(path, "scheduler.json")))
    for name, extra in (extras or {}).items():
        _load_extra(path / name, extra, with_optimizer=optimizer is not None)
    _load_rng(path)
    for name, read in (loop_files or {}).items():
        read(path / name)
    return trainer["trainer_state"]


def prune(root: str | Path, keep_last: int) -> None:
    """Delete every checkpoint under `root` but the `keep_last` newest committed ones (only
    committed ones count: a cut-short or damaged save never pushes a good one out)."""
    found = inventory(root)
    keep = {f.step for f in [f for f in found if f.state == "committed"][-keep_last:]}
    for checkpoint in found:
        if checkpoint.step not in keep:
            _delete(checkpoint.location)


# --- Weights -------------------------------------------------------------------------------------


def _load_weights(model: torch.nn.Module, model_dir: Path) -> None:
    """Copy the saved weights into `model`; every parameter and persistent buffer must be saved.

    save_pretrained stores tied weights (a head sharing the embedding) once, so a key may be
    missing when another key names the same tensor. Keys are compared as the model names them:
    architectures that transformers renames on save would be refused here, not loaded wrongly.
    """
    saved = _checked_weights(model, model_dir)
    model.load_state_dict(saved, strict=False)  # checked above, tied keys included


def _read_weights(model: torch.nn.Module, model_dir: Path) -> dict[str, torch.Tensor]:
    """The saved weights under every name `model` has for them (a tied tensor under each)."""
    saved = _checked_weights(model, model_dir)
    expected = model.state_dict(keep_vars=True)
    first = {id(tensor): name for name, tensor in reversed(expected.items()) if name in saved}
    return {name: saved[first[id(tensor)]] for name, tensor in expected.items()}


def _checked_weights(model: torch.nn.Module, model_dir: Path) -> dict[str, torch.Tensor]:
    saved: dict[str, torch.Tensor] = {}
    for name in _weight_files(model_dir):
        saved.update(load_file(model_dir / name))
    expected = model.state_dict(keep_vars=True)
    loaded = {id(expected[key]) for key in saved if key in expected}
    missing = [key for key, tensor in expected.items() if id(tensor) not in loaded]
    unexpected = sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"weights in {model_dir} do not match the model: missing {missing or 'none'}, "
            f"unexpected {unexpected or 'none'}"
        )
    return saved


def _weight_files(model_dir: Path) -> list[str]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():  # sharded: large models
        return sorted(set(_read_json(index)["weight_map"].values()))
    return ["model.safetensors"]


def _save_extra(
    directory: Path, extra: Extra, deferred: _Deferred | None, *, with_optimizer: bool
) -> None:
    directory.mkdir()
    weights = {k: v.detach().contiguous() for k, v in extra.module.state_dict().items()}
    _save_tensors(directory / "weights.safetensors", weights, deferred)
    if with_optimizer and extra.optimizer is not None:
        _save_optimizer(directory, extra.optimizer, deferred)
    if with_optimizer and extra.scheduler is not None:
        _write_json(directory / "scheduler.json", extra.scheduler.state_dict())


def _load_extra(directory: Path, extra: Extra, *, with_optimizer: bool) -> None:
    weights = directory / "weights.safetensors"
    if not weights.is_file():
        raise ValueError(f"{directory.parent} holds no {directory.name}/weights.safetensors")
    extra.module.load_state_dict(load_file(weights), strict=True)
    if with_optimizer and extra.optimizer is not None:
        _load_optimizer(directory, extra.optimizer)
    if with_optimizer and extra.scheduler is not None:
        extra.scheduler.load_state_dict(_read_json(_saved(directory, "scheduler.json")))


# --- Optimizer -----------------------------------------------------------------------------------


def _save_optimizer(
    directory: Path, optimizer: torch.optim.Optimizer, deferred: _Deferred | None = None
) -> None:
    _save_optimizer_state(directory, optimizer.state_dict(), deferred)


def _save_optimizer_state(
    directory: Path, state_dict: dict[str, Any], deferred: _Deferred | None = None
) -> None:
    tensors: dict[str, torch.Tensor] = {}
    plain = {
        # JSON keys are strings; the parameter indices are turned back into ints on load.
        "state": {
            str(index): _encode(state, f"state.{index}", tensors)
            for index, state in state_dict["state"].items()
        },
        "param_groups": _encode(state_dict["param_groups"], "param_groups", tensors),
    }
    _save_tensors(directory / "optimizer.safetensors", tensors, deferred)
    _write_json(directory / "optimizer.json", plain)


def _load_optimizer(directory: Path, optimizer: torch.optim.Optimizer) -> None:
    optimizer.load_state_dict(_read_optimizer(directory))


def _read_optimizer(directory: Path) -> dict[str, Any]:
    """The saved optimizer state_dict, keyed by parameter index as Optimizer.state_dict() is."""
    plain = _read_json(_saved(directory, "optimizer.json"))
    tensors = load_file(directory / "optimizer.safetensors")
    return {
        "state": {int(index): _decode(s, tensors) for index, s in plain["state"].items()},
        "param_groups": _decode(plain["param_groups"], tensors),
    }


def _encode(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """`value` as JSON-able data: each tensor moves into `tensors` under its dotted `key`."""
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().contiguous()
        return {_TENSOR: key}
    if isinstance(value, dict):
        return {name: _encode(item, f"{key}.{name}", tensors) for name, item in value.items()}
    if isinstance(value, list | tuple):
        items = [_encode(item, f"{key}.{i}", tensors) for i, item in enumerate(value)]
        return {_TUPLE: items} if isinstance(value, tuple) else items
    return value


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if _TENSOR in value:
            return tensors[value[_TENSOR]]
        if _TUPLE in value:
            return tuple(_decode(item, tensors) for item in value[_TUPLE])
        return {name: _decode(item, tensors) for name, item in value.items()}
    if isinstance(value, list):
        return [_decode(item, tensors) for item in value]
    return value


# --- Random number generators --------------------------------------------------------------------


def _save_rng(directory: Path) -> None:
    tensors = {"torch": torch.get_rng_state()}
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    tensors.update({f"cuda.{device}": state for device, state in enumerate(cuda_states)})
    numpy_state = np.random.get_state(legacy=False)
    # safetensors' torch side has no uint32; int64 holds the MT19937 key exactly.
    tensors["numpy.key"] = torch.from_numpy(numpy_state["state"].pop("key").astype(np.int64))
    version, internal, gauss_next = random.getstate()
    save_file(tensors, directory / "rng.safetensors")
    _write_json(
        directory / "rng.json",
        {
            "cuda_devices": len(cuda_states),
            "numpy": numpy_state,
            "python": {"version": version, "state": internal, "gauss_next": gauss_next},
        },
    )


def _load_rng(directory: Path) -> None:
    tensors = load_file(directory / "rng.safetensors")
    plain = _read_json(directory / "rng.json")
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        # Resuming on fewer GPUs than were saved restores the devices that exist.
        for device in range(min(plain["cuda_devices"], torch.cuda.device_count())):
            torch.cuda.set_rng_state(tensors[f"cuda.{device}"], device)
    numpy_state = plain["numpy"]
    numpy_state["state"]["key"] = tensors["numpy.key"].numpy().astype(np.uint32)
    np.random.set_state(numpy_state)
    python = plain["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss_next"]))


def rng_state() -> dict[str, Any]:
    """This process's RNG states as plain JSON data: for ranks other than the one that writes the
    checkpoint (whose states go to rng.safetensors), carried in the trainer state."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = numpy_state["state"]["key"].tolist()
    version, internal, gauss_next = random.getstate()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {
        "torch": torch.get_rng_state().tolist(),
        "cuda": [state.tolist() for state in cuda],
        "numpy": numpy_state,
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what rng_state() returned."""
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8, device="cpu"))
    if torch.cuda.is_available():
        for device, saved in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.tensor(saved, dtype=torch.uint8, device="cpu"), device)
    numpy_state = dict(state["numpy"])
    numpy_state["state"] = {
        **numpy_state["state"],
        "key": np.array(numpy_state["state"]["key"], dtype=np.uint32),
    }
    np.random.set_state(numpy_state)
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss_next"]))


# --- Files ---------------------------------------------------------------------------------------


def _dumps(data: Any) -> str:
    return json.dumps(data, indent=2)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(_dumps(data), encoding="utf-8")


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _saved(directory: Path, name: str) -> Path:
    """`directory / name`, which a checkpoint saved without optimizer state lacks."""
    path = directory / name
    if not path.is_file():
        raise ValueError(
            f"{directory} holds no {name} (saved with checkpoint.save_optimizer = false?); "
            "pass optimizer=None and scheduler=None to resume with fresh ones"
        )
    return path


# --- Directories ---------------------------------------------------------------------------------
#
# A checkpoint directory is a Path under a local root, or a URL string under a remote one.


def _stage(root: str | Path, name: str) -> Path:
    """A fresh local temp directory to write checkpoint `name` into: beside the checkpoints
    under a local root (after deleting the leftovers of saves that crashed), in the system's
    temp directory for a remote one."""
    if is_url(root):
        return Path(tempfile.mkdtemp(prefix=f"rollout-{name}-"))
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for entry in root.iterdir():
        if _TEMP_DIR.fullmatch(entry.name) and entry.is_dir():
            shutil.rmtree(entry)
    return Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))


def _publish(staged: Staged, manifest: bytes) -> Path | str:
    """Make the staged directory checkpoint `staged.name` under its root (replacing any), the
    manifest last."""
    if is_url(staged.root):
        return _upload(staged, manifest)
    staging, final = staged.directory, Path(staged.root) / staged.name
    for path in sorted(staging.rglob("*"), reverse=True):  # files before their directories
        _fsync(path)
    (staging / MANIFEST).write_bytes(manifest)
    _fsync(staging / MANIFEST)
    _fsync(staging)
    # A directory cannot be renamed over a non-empty one: move the old one aside first. A crash
    # between the two renames leaves the step missing, and the previous one as latest.
    replaced = _move_aside(final) if final.exists() else None
    os.rename(staging, final)
    _fsync(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced)
    return final


def _upload(staged: Staged, manifest: bytes) -> str:
    root = str(staged.root).rstrip("/")
    fs, base = filesystem(root)
    target = f"{base.rstrip('/')}/{staged.name}"
    if fs.exists(target):  # a checkpoint of this step, committed or cut short: replaced
        _delete(f"{root}/{staged.name}")
    for path in sorted(p for p in staged.directory.rglob("*") if p.is_file()):
        remote = f"{target}/{path.relative_to(staged.directory).as_posix()}"
        _retried(lambda path=path, remote=remote: fs.put_file(str(path), remote))
    _retried(lambda: fs.pipe_file(f"{target}/{MANIFEST}", manifest))  # last: now it commits
    return f"{root}/{staged.name}"


UPLOAD_ATTEMPTS = 3


def _retried(upload: Callable[[], object]) -> None:
    """One file's upload, tried again after a failure: an object store under load answers a
    large multipart upload with a 500 now and then (the client's own retries of the closing
    call can then find the upload gone). A bucket that is gone fails every attempt."""
    for attempt in range(1, UPLOAD_ATTEMPTS + 1):
        try:
            upload()
            return
        except OSError:
            if attempt == UPLOAD_ATTEMPTS:
                raise
            time.sleep(2**attempt)


@contextlib.contextmanager
def _downloaded(url: str, manifest: dict[str, Any]) -> Iterator[Path]:
    """The files `manifest` lists (only those: nothing unhashed is read), in a temp directory."""
    fs, path = filesystem(url)
    with tempfile.TemporaryDirectory(prefix="rollout-checkpoint-") as local:
        remote, destinations = [], []
        for name in manifest["files"]:
            destination = Path(local, name)
            destination.parent.mkdir(parents=True, exist_ok=True)
            remote.append(f"{path.rstrip('/')}/{name}")
            destinations.append(str(destination))
        try:
            fs.get(remote, destinations)  # one call: s3fs and gcsfs fetch them concurrently
        except FileNotFoundError:  # one is missing: fetch the others, the check names it
            for source, destination in zip(remote, destinations, strict=True):
                with contextlib.suppress(FileNotFoundError):
                    fs.get_file(source, destination)
        yield Path(local)


def _delete(directory: Path | str) -> None:
    if isinstance(directory, str):
        fs, path = filesystem(directory)
        # The manifest first: from then on it is not a checkpoint, whatever else survives.
        if fs.exists(f"{path}/{MANIFEST}"):
            fs.rm_file(f"{path}/{MANIFEST}")
        if fs.exists(path):
            fs.rm(path, recursive=True)
    else:
        shutil.rmtree(_move_aside(directory))


def _move_aside(directory: Path) -> Path:
    """Rename `directory` to a temp name, so that it stops counting as a checkpoint at once and is
    deleted by the next save if deleting it now is interrupted."""
    aside = directory.with_name(f".{directory.name}.tmp-{secrets.token_hex(4)}")
    os.rename(directory, aside)
    return aside


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # directories too: that makes renames inside them durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
