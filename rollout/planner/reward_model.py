"""A trained reward model as a reward source (`rewards = [{ model = "..." }]`), found at plan time.

The location may be a run directory, its checkpoints directory, `.../checkpoints/last` (the latest
complete checkpoint), one checkpoint `.../step-000100`, or the Hugging Face directory inside one.
The plan freezes which directory that was, with the sha256 of its weights, so a run scores with the
very model that was planned, and a plan whose reward model changed since is stale.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rollout.errors import Issue, PlanError
from rollout.fingerprints import sha256_file
from rollout.planner import locations
from rollout.plugins.identity import PluginIdentity

_STEP = re.compile(r"step-(\d+)")
_COMPLETE = "manifest.json"  # rollout.runtime.manifest.MANIFEST: written last, it commits a save
SCORER = ("rollout.harness.model_reward", "ModelReward")


def resolve_reward_model(location: str, *, base_dir: Path, used_by: str) -> PluginIdentity:
    """The planned identity of a reward model; PlanError at ``used_by`` if there is none there."""
    path = Path(locations.resolve(location, base_dir).removeprefix("file://"))
    directory = _model_directory(path, location, used_by)
    weights = _weights(directory, location, used_by)
    _check_is_reward_model(directory, location, used_by)
    return PluginIdentity(
        used_by=used_by,
        ref=location,
        kind="file",
        module=SCORER[0],
        qualname=SCORER[1],
        path=str(weights),
        sha256=sha256_file(str(weights)),
        signature="(prompts, completions, **fields)",
    )


def model_directory_of(identity: PluginIdentity) -> Path:
    """The Hugging Face directory a planned reward model identity stands for."""
    return Path(identity.path or "").parent


def _model_directory(path: Path, location: str, used_by: str) -> Path:
    if path.name == "last":
        checkpoints = path.parent
    elif (path / "checkpoints").is_dir():
        checkpoints = path / "checkpoints"
    elif path.is_dir() and _steps(path):
        checkpoints = path
    else:
        checkpoints = None
    if checkpoints is not None:
        complete = [step for step in _steps(checkpoints) if (step / _COMPLETE).is_file()]
        if not complete:
            raise _error(
                used_by,
                location,
                f"{checkpoints} holds no complete checkpoint",
                "wait for the reward-model run to save one, or point at a checkpoint directory",
            )
        path = complete[-1]
    if (path / "model" / "config.json").is_file():
        return path / "model"
    if (path / "config.json").is_file():
        return path
    raise _error(
        used_by,
        location,
        f"{path} is not a checkpoint or model directory (no model/config.json or config.json)",
        "point at a reward-model run's checkpoints/last, a step-NNNNNN checkpoint, or its model "
        "directory; relative paths start at the config file's directory",
    )


def _steps(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    found = [
        (int(match.group(1)), entry)
        for entry in directory.iterdir()
        if (match := _STEP.fullmatch(entry.name)) and entry.is_dir()
    ]
    return [entry for _, entry in sorted(found)]


def _weights(directory: Path, location: str, used_by: str) -> Path:
    for name in ("model.safetensors", "model.safetensors.index.json"):
        if (directory / name).is_file():
            return directory / name
    raise _error(
        used_by,
        location,
        f"{directory} holds no safetensors weights",
        "point at a reward model saved by rollout (kind = 'rm')",
    )


def _check_is_reward_model(directory: Path, location: str, used_by: str) -> None:
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _error(
            used_by, location, f"cannot read {directory / 'config.json'}: {exc}", None
        ) from None
    architecture = (config.get("architectures") or ["?"])[0]
    labels = config.get("num_labels", len(config.get("id2label") or {}) or None)
    if not architecture.endswith("ForSequenceClassification") or labels != 1:
        raise _error(
            used_by,
            location,
            f"{directory} holds a {architecture} with {labels} labels, not a reward model (a "
            "sequence classifier with one output)",
            'train one with algorithm.kind = "rm", or use fn = ... for a reward function',
        )


def _error(used_by: str, location: str, message: str, hint: str | None) -> PlanError:
    return PlanError(Issue(used_by, message, value=location, hint=hint))
