"""[[rewards]]: plugin functions (or trained reward models) that score completions, combined by
weight."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from rollout.config.base import ConfigModel

# module.path:function | ./file.py:function | file.py:function | entry-point-or-builtin-name
_MODULE_REF = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_.]*"
_FILE_REF = r"[^:]+\.py:[A-Za-z_][A-Za-z0-9_.]*"
_NAME_REF = r"[A-Za-z_][A-Za-z0-9_.-]*"
PLUGIN_REF_PATTERN = rf"^({_MODULE_REF}|{_FILE_REF}|{_NAME_REF})$"
_PLUGIN_REF = re.compile(PLUGIN_REF_PATTERN)


def check_plugin_ref(value: str) -> str:
    if not _PLUGIN_REF.match(value):
        raise ValueError(
            "a plugin reference is 'package.module:function', './file.py:function', or the name "
            "of a built-in or an installed entry point (e.g. 'numeric_match')"
        )
    return value


def check_options_are_finite(options: dict[str, Any]) -> dict[str, Any]:
    """Options reach plan.lock as JSON, where nan and inf do not exist: refuse them here."""

    def walk(value: Any, where: str) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{where} is {value}: options must be finite numbers")
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{where}.{key}")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{where}[{i}]")

    for key, value in options.items():
        walk(value, key)
    return options


PluginRef = Annotated[
    str,
    AfterValidator(check_plugin_ref),
    Field(examples=["numeric_match", "my_pkg.rewards:score", "./rewards.py:score"]),
]


class RewardSpec(ConfigModel):
    fn: PluginRef | None = Field(
        default=None,
        description="The reward function: a built-in name ('numeric_match', 'exact_match', "
        "'regex_match', 'length_penalty', 'code_tests'), 'package.module:function', './file.py:function' "
        "(relative to the config file), or an entry point in the 'rollout.rewards' group. It is "
        "called as fn(prompts, completions, **fields, **options) and returns one float per "
        "completion; it receives the dataset fields it names as parameters (all of them if it "
        "takes **kwargs). Set exactly one of fn and model.",
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        description="A reward model trained with algorithm.kind = 'rm' scores each (prompt, "
        "completion): a checkpoint directory ('runs/RUN_ID/checkpoints/step-000100'), "
        "'.../checkpoints/last' for a run's latest checkpoint, a run directory (its latest), or "
        "the Hugging Face directory inside a checkpoint. Relative to the config file's "
        "directory. Set exactly one of fn and model.",
    )
    weight: float = Field(default=1.0, description="Weight of this reward in the weighted sum.")
    name: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Name used in metrics. Default: the function's name.",
    )
    options: Annotated[dict[str, Any], AfterValidator(check_options_are_finite)] = Field(
        default_factory=dict,
        description="Keyword arguments passed to the function on every call (a reward model "
        "takes none).",
    )
    timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Longest one call may take; past it the step stops with an error naming the "
        "plugin.",
    )

    isolation: Literal["in_process", "sidecar"] = Field(
        default="in_process",
        description="Where the function runs. 'in_process': in the worker, the fastest; a call "
        "past timeout_s stops the step, but code stuck in C or holding the GIL (a backtracking "
        "regex) is not interrupted, and a segfault ends the worker. 'sidecar': in a process of "
        "its own (docs/sidecar.md), killed at timeout_s and restarted with the batch resubmitted "
        "once; a crash is survived the same way. Costs a round trip per batch.",
    )
    on_error: Literal["stop", "fail_sample"] = Field(
        default="stop",
        description="When the sidecar hangs, crashes or raises on a batch, the batch is bisected "
        "to find the samples it fails on alone (docs/sidecar.md). 'stop': the step stops with an "
        "error naming the reward, the sample and the cause. 'fail_sample': those samples are "
        "scored failure_score, the reason is logged, and the rest of the batch keeps its scores. "
        "'fail_sample' needs isolation = 'sidecar' (only a process of its own can be killed and "
        "asked again).",
    )
    failure_score: float = Field(
        default=0.0,
        allow_inf_nan=False,
        description="The score of a sample this reward failed on (on_error = 'fail_sample'), "
        "before weighting.",
    )
    python: str | None = Field(
        default=None,
        min_length=1,
        description="With isolation = 'sidecar': the Python interpreter the sidecar runs "
        "(e.g. '/opt/venvs/judge/bin/python'); rollout and the plugin must import there. "
        "Default: the Python running rollout. Only with a sidecar.",
    )

    allow_unsandboxed: bool = Field(
        default=False,
        description="Let a reward that runs model-written code (code_tests, or a function with "
        "runs_model_code = True) run although this host's sandbox lacks a capability (network "
        "isolation, ...): the plan then warns instead of refusing, and plan.lock records it. "
        "Only with such a reward.",
    )

    @property
    def metric_name(self) -> str:
        """The name in metrics: `name`, else the function's name, else 'reward_model'."""
        if self.name:
            return self.name
        return self.fn.rsplit(":", 1)[-1] if self.fn else "reward_model"
