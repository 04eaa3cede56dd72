"""What `rollout serve` serves: a model named by a config, a path or a checkpoint, loaded as a
training worker loads it (rollout.models.loading.load_model), behind an EngineService
(rollout.serve.loading.served_engine). `--engine` picks the engine (hf, or an engine plugin);
`--dev` lets /admin/reload re-import a plugin's code and swap the engine between requests.

Sources, exactly one:
- a config file: its [model] section (with its tokenizer and chat template overrides) and its
  [generation] section as the request defaults;
- a model: a Hugging Face directory, a .gguf file, `builtin:NAME` or `package:NAME`;
- a checkpoint: a step directory (runs/<id>/checkpoints/step-000010), a run directory or its
  checkpoints directory (the latest complete step), or a run id from the run store. Completions
  then carry the checkpoint's step as their policy version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rollout.config.model import ModelSection
from rollout.errors import Issue, RolloutError
from rollout.serve.loading import served_engine
from rollout.serve.protocol import Defaults


@dataclass(frozen=True)
class ServeSource:
    """The model to serve and how, as the command line gave it."""

    section: ModelSection
    base_dir: Path
    name: str
    defaults: Defaults
    max_batch_size: int | None = None
    policy_version: int = 0
    option: str = "--model"
    """The option that named the model, where its problems are reported."""
    engine: str | None = None
    """The config's [generation] engine (a --config source); --engine overrides it."""


def resolve_source(
    *, config: Path | None, model: str | None, checkpoint: str | None, name: str | None
) -> ServeSource:
    """The one source among --config, --model and --checkpoint (a RolloutError otherwise)."""
    given = [
        flag
        for flag, value in (("--config", config), ("--model", model), ("--checkpoint", checkpoint))
        if value is not None
    ]
    if len(given) != 1:
        raise RolloutError(
            Issue(
                "rollout serve",
                "give exactly one of --config, --model or --checkpoint"
                + (f" (got {', '.join(given)})" if given else ""),
                hint="e.g. rollout serve --model builtin:tiny-llama",
            )
        )
    if config is not None:
        return _from_config(config, name)
    if model is not None:
        section = _model_section(model)
        # A URL's name is the last part of its path: its query may hold a signature or a token.
        where = urlsplit(model).path if "://" in model else model
        default_name = section.builtin or section.package or Path(where).name
        return ServeSource(section, Path.cwd(), name or default_name, Defaults())
    assert checkpoint is not None
    step_dir = _checkpoint_dir(checkpoint)
    section = ModelSection(path=str(step_dir / "model"))
    default_name = f"{step_dir.parent.parent.name}/{step_dir.name}"
    return ServeSource(
        section,
        Path.cwd(),
        name or default_name,
        Defaults(),
        policy_version=_step(step_dir),
        option="--checkpoint",
    )


def load_served(
    source: ServeSource,
    *,
    device: str,
    dtype: str,
    seed: int | None,
    max_batch_size: int | None,
    engine: str | None = None,
    dev: bool = False,
) -> Any:
    """Load the model and start its service: a ServedModel. `engine`: --engine, "hf" or an
    engine plugin's reference relative to the current directory; None: a config source's
    [generation] engine (relative to the config), else hf. `dev`: the engine can be reloaded
    (re-importing the plugin's code) through the server's /admin/reload route."""
    from rollout.inference.model_choice import inspect_model_at
    from rollout.models.loading import load_model

    choice = choose_engine(engine, source)
    engine = choice.ref
    plugin = _engine_plugin(choice)
    facts = inspect_model_at(source.section, source.base_dir, source.option)
    if dtype == "auto":
        dtype = source.section.dtype
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "bfloat16"
    loaded = load_model(facts, source.section, dtype=dtype, device=device, base_dir=source.base_dir)
    batch = max_batch_size or source.max_batch_size

    def build(resolved: Any) -> Any:
        built = _build_served_engine(choice, resolved, loaded, device, batch, seed)
        built.load_weights(None, version=source.policy_version)
        return built

    served = served_engine(
        build(plugin),
        loaded.tokenizer,
        loaded.chat_template,
        name=source.name,
        defaults=source.defaults,
        model_config=loaded.model.config,
        max_batch_size=batch,
        reloadable=dev,
    )
    if dev:
        served.reload = _reloader(choice, plugin, served, build, loaded.tokenizer, batch)
    return served


ENGINE_FLAG = "--engine"


@dataclass(frozen=True)
class EngineChoice:
    """The engine to serve, where it was named (for errors) and what a file plugin's path is
    relative to."""

    ref: str
    where: str
    base_dir: Path


def choose_engine(flag: str | None, source: ServeSource) -> EngineChoice:
    """--engine when given; else the config's [generation] engine (a served config runs the
    engine it trains with); else hf."""
    if flag is not None:
        return EngineChoice(flag, ENGINE_FLAG, Path.cwd())
    if source.engine is not None:
        return EngineChoice(source.engine, "generation.engine", source.base_dir)
    return EngineChoice("hf", ENGINE_FLAG, Path.cwd())


def _engine_plugin(choice: EngineChoice) -> Any:
    """The resolved plugin the choice names (None for hf); vllm is refused: it keeps no decode
    batch for concurrent requests."""
    from rollout.config.generation import BUILTIN_ENGINES, check_engine, is_plugin_engine
    from rollout.config.translate import did_you_mean_choice

    engine = choice.ref
    try:
        check_engine(engine)
    except ValueError as error:
        hint = did_you_mean_choice(engine, list(BUILTIN_ENGINES))
        raise RolloutError(Issue(choice.where, str(error), value=engine, hint=hint)) from None
    if engine == "vllm":
        raise RolloutError(
            Issue(
                choice.where,
                "rollout serve drives the hf engine (or an engine plugin); vllm has a server of "
                "its own",
                value=engine,
                hint="--engine hf, or run `vllm serve` for vLLM",
            )
        )
    if not is_plugin_engine(engine):
        return None
    from rollout.planner.engine import resolve_engine_ref

    return resolve_engine_ref(engine, base_dir=choice.base_dir, used_by=choice.where)


def _build_served_engine(
    choice: EngineChoice,
    resolved: Any,
    loaded: Any,
    device: str,
    batch: int | None,
    seed: int | None,
) -> Any:
    from rollout.engines.build import build_engine
    from rollout.engines.plugin import EnginePlugin

    plugin = None
    if resolved is not None:
        plugin = EnginePlugin(resolved.identity.ref, choice.where, resolved.fn)
    return build_engine(
        choice.ref,  # hf: EngineService drives its decode batch; a plugin: whole generate calls
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        eos_token_ids=loaded.eos_token_ids,
        pad_token_id=loaded.pad_token_id,
        device=device,
        max_batch_size=batch,
        seed=seed,
        keep_packed=True,  # served weights never change
        plugin=plugin,
    )


def _reloader(
    choice: EngineChoice, plugin: Any, served: Any, build: Any, tokenizer: Any, batch: int | None
) -> Any:
    """/admin/reload's work: re-import the plugin's code, build the engine anew on the same
    model, swap it in between requests; the old and new identity. Code that fails to import (or
    to build) leaves the old engine serving, as a RolloutError."""
    import threading

    from rollout.serve.loading import engine_service

    state = {"plugin": plugin}
    lock = threading.Lock()  # one reload at a time

    def reload() -> dict[str, Any]:
        with lock:
            old = state["plugin"]
            if old is None:
                raise RolloutError(
                    Issue(
                        choice.where,
                        f"the served engine is the built-in {choice.ref!r}: there is no plugin code "
                        "to reload",
                        hint="serve an engine plugin: rollout serve --dev --engine ./engine.py:make",
                    )
                )
            _forget_module(old.identity)
            new = _engine_plugin(choice)
            built = build(new)
            served.service.swap(lambda: engine_service(built, tokenizer, max_batch_size=batch))
            state["plugin"] = new
            return {
                "engine": choice.ref,
                "old": old.identity.model_dump(mode="json"),
                "new": new.identity.model_dump(mode="json"),
            }

    return reload


def _forget_module(identity: Any) -> None:
    """Make the next import of a module plugin (or an entry point's module) read its source
    again; a file plugin is executed afresh at every resolve anyway."""
    import sys

    if identity.kind in ("module", "entry_point"):
        # Dropped rather than importlib.reload-ed: the import that follows reports a failure in
        # the new code as every plugin import does (one issue, its file and line).
        sys.modules.pop(identity.module, None)


def _from_config(path: Path, name: str | None) -> ServeSource:
    from rollout.config import load_config

    config = load_config(path)
    generation = config.generation
    defaults = Defaults(
        max_tokens=generation.max_new_tokens,
        temperature=generation.temperature,
        top_p=generation.top_p,
        top_k=generation.top_k,
        stop=tuple(generation.stop),
    )
    section = config.model
    default_name = section.builtin or section.package or section.hub or config.run.name
    return ServeSource(
        section,
        path.resolve().parent,
        name or default_name,
        defaults,
        max_batch_size=generation.max_batch_size,
        option="model",
        engine=generation.engine,
    )


def _model_section(model: str) -> ModelSection:
    """--model read as `rollout generate` reads it."""
    from rollout.inference.model_choice import model_source

    chosen = {k: v for k, v in model_source(model).items() if v is not None and k != "format"}
    return _section("--model", **chosen)


def _section(flag: str, **fields: Any) -> ModelSection:
    from pydantic import ValidationError

    try:
        return ModelSection(**fields)
    except ValidationError as error:
        message = "; ".join(e["msg"] for e in error.errors())
        raise RolloutError(Issue(flag, message, value=next(iter(fields.values())))) from None


def _checkpoint_dir(checkpoint: str) -> Path:
    """The step directory --checkpoint names (a step, run or checkpoints directory, or a run
    id), found as `rollout generate --checkpoint` finds it."""
    from rollout.inference.model_choice import find_checkpoint

    return find_checkpoint(checkpoint).model_dir.parent


def _step(step_dir: Path) -> int:
    """The checkpoint's training step: the policy version of what it samples."""
    try:
        return int(json.loads((step_dir / "trainer.json").read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        digits = "".join(c for c in step_dir.name if c.isdigit())
        return int(digits) if digits else 0
