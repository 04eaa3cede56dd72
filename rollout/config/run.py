"""[run]: what the run is called, how it is seeded, where its directory goes."""

from __future__ import annotations

from pydantic import Field

from rollout.config.base import ConfigModel
from rollout.config.secrets import LocalPath

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class RunSection(ConfigModel):
    name: str = Field(
        default="run",
        pattern=RUN_NAME_PATTERN,
        description="Human name of the run; becomes the prefix of the run id. Letters, digits, "
        "'.', '_' and '-' only (it is used in paths), at most 64 characters.",
    )
    seed: int = Field(
        default=0,
        ge=0,
        description="Root seed. Every other seed (data order, sampling, per-rank streams) is derived "
        "from it at plan time and recorded in plan.lock.",
    )
    output_dir: LocalPath = Field(
        default="runs",
        min_length=1,
        description="Local directory that holds one sub-directory per run (plan copy, logs, and "
        "checkpoints unless storage.artifacts says otherwise). Relative to the working directory.",
    )
    eval_interval: int | None = Field(
        default=None,
        ge=1,
        description="Evaluate on data.eval every this many steps (and at the end). None: only at the "
        "end, when data.eval is set.",
    )
    eval_samples: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Completions (or episodes) per data.eval row. 1: one greedy completion. "
        "More: sampled at [generation]'s temperature, top_p and top_k (on the same seed at every "
        "evaluation), and eval/* is their mean: the held-out success of the policy as it "
        "samples, which is what an online run trains. Online algorithms only.",
    )
