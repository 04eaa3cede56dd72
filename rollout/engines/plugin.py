"""The engine plugin contract, in one place: `make(spec) -> Engine`.

An engine plugin ([generation] engine = "./engine.py:make", "my_pkg.engines:make", or the name
of an entry point in the `rollout.engines` group) is a factory called once per engine with an
EngineSpec, what build_engine was given, and returning an object with the Engine Protocol's
members (rollout.engines.base.Engine). The easiest plugin wraps the built-in hf engine:

    class MyEngine(WrappedEngine):          # delegates every member to the hf engine...
        def generate(self, prompts, params): # ...but the one it changes
            ...

    def make(spec):
        return MyEngine(spec.hf_engine())

Two checks keep a wrong plugin one clear error: `factory_problems` when the reference is resolved
(at plan, or by a command that takes --engine: it is callable with one argument and, where a
class or return annotation says what it builds, that builds an engine), and `checked_engine` on
what the factory returned, in build_engine. This module imports nothing of rollout but the
errors: the planner reaches factory_problems through the plugin registry.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout.errors import Issue, PlanError

if TYPE_CHECKING:
    from rollout.engines.base import Engine

ENGINE_METHODS = ("generate", "load_weights", "close")
ENGINE_PROPERTIES = ("policy_version", "stats")

CONTRACT = (
    "an engine plugin is make(spec) returning an object with generate(prompts, params), "
    "load_weights(weights, version), close() and the properties policy_version and stats "
    "(rollout.engines.base.Engine)"
)


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is built from: build_engine's arguments, for a plugin's factory."""

    model: Any
    """The loaded transformers model. In training it is the learner's own module: its weights
    change in place, and load_weights is then called with None (only the version moves)."""
    tokenizer: Any
    eos_token_ids: Sequence[int]
    pad_token_id: int
    device: str
    max_batch_size: int | None
    """Most sequences decoded at once; None: the engine's own choice."""
    seed: int | None = None
    """Seed of the engine's own sampling stream (used when a call brings no seed); None: random."""
    model_dir: Path | None = None
    """A Hugging Face directory of the model, when the caller has one (vllm's)."""
    dtype: str = "auto"
    max_context: int | None = None
    """Prompt plus completion tokens at most, when known (a run's)."""
    cuda_graphs: bool | None = None
    """[generation] cuda_graphs: None auto, else required on or off."""
    keep_packed: bool = False
    """The weights never change (generate, eval, serve): hf may pack them once."""

    def hf_engine(self) -> Engine:
        """The built-in hf engine over this spec: what a plugin that wraps it delegates to."""
        from rollout.engines.build import build_engine

        return build_engine(
            "hf",
            model=self.model,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            device=self.device,
            max_batch_size=self.max_batch_size,
            seed=self.seed,
            keep_packed=self.keep_packed,
            cuda_graphs=self.cuda_graphs,
            max_context=self.max_context,
        )


class WrappedEngine:
    """An engine that delegates every member to another (`inner`, usually `spec.hf_engine()`):
    a plugin that changes one thing subclasses it and overrides that one method.

        class Marking(WrappedEngine):
            def generate(self, prompts, params):
                return [replace(c, text="[m]" + c.text) for c in super().generate(prompts, params)]
    """

    def __init__(self, inner: Engine):
        self.inner = inner

    def generate(self, prompts: Any, params: Any) -> Any:
        return self.inner.generate(prompts, params)

    def load_weights(self, weights: Any, version: int) -> None:
        self.inner.load_weights(weights, version)

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    @property
    def stats(self) -> Any:
        return self.inner.stats

    def close(self) -> None:
        self.inner.close()


def missing_members(obj: Any, *, instance: bool = True) -> list[str]:
    """The Engine members ``obj`` lacks, as 'generate()' or 'stats'. For a class (instance
    False) only the methods count: its instances may set the properties' names in __init__."""
    missing = [f"{name}()" for name in ENGINE_METHODS if not callable(getattr(obj, name, None))]
    if instance:
        # A property may compute on access (and fail before the engine ran): presence counts.
        missing += [name for name in ENGINE_PROPERTIES if not _has_attr(obj, name)]
    return missing


@dataclass(frozen=True)
class EnginePlugin:
    """An engine plugin's factory, loaded by the caller of build_engine from the identity the
    reference resolved to (rollout.runtime.engine_plugin.load_engine_plugin)."""

    ref: str
    """The reference as written, e.g. './engine.py:make'."""
    used_by: str
    """Where it was written: 'generation.engine' or '--engine'."""
    factory: Callable[[EngineSpec], Any]


def checked_engine(built: Any, plugin: EnginePlugin) -> Engine:
    """What an engine plugin's factory returned, if it is an engine; else one RolloutError naming
    the plugin and what the object lacks."""
    missing = missing_members(built)
    if missing:
        raise PlanError(
            Issue(
                plugin.used_by,
                f"the engine plugin {plugin.ref!r} returned a {type(built).__name__}, which "
                f"has no {', '.join(missing)}",
                value=plugin.ref,
                hint=CONTRACT,
            )
        )
    return built


def factory_problems(fn: Callable[..., Any]) -> list[str]:
    """What can be told wrong with a factory without calling it (which needs a model): it takes
    one positional argument, and the class it is, or its return annotation names, is an engine."""
    problems = []
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some C callables)
        signature = None
    if signature is not None:
        try:
            signature.bind(object())
        except TypeError:
            problems.append(f"it cannot be called as make(spec): its signature is {signature}")
    built = fn if inspect.isclass(fn) else _return_class(fn)
    if built is not None and (missing := missing_members(built, instance=False)):
        problems.append(f"it builds a {built.__name__}, which has no {', '.join(missing)}")
    return problems


def _has_attr(obj: Any, name: str) -> bool:
    return inspect.getattr_static(obj, name, _ABSENT) is not _ABSENT


_ABSENT = object()


def _return_class(fn: Callable[..., Any]) -> type | None:
    try:
        annotation = typing.get_type_hints(fn).get("return")
    except Exception:  # an annotation that does not resolve says nothing either way
        return None
    return annotation if inspect.isclass(annotation) else None
