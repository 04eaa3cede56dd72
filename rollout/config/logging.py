"""[logging]: where metrics and logs go besides the run store."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollout.config.base import ConfigModel
from rollout.config.secrets import SecretRef

Tracker = Literal["console", "jsonl", "tensorboard", "wandb"]


class LoggingSection(ConfigModel):
    trackers: list[Tracker] = Field(
        default_factory=lambda: ["console"],
        description="Metric sinks besides the run store (which always records): console (progress "
        "bar and summary), jsonl (metrics.jsonl in the run directory), tensorboard, wandb.",
    )
    level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Lowest log level recorded."
    )
    interval: int = Field(default=1, ge=1, description="Record metrics every this many steps.")
    wandb_project: str | None = Field(
        default=None, min_length=1, description="Weights & Biases project (wandb tracker only)."
    )
    wandb_api_key: SecretRef | None = Field(
        default=None,
        description="Weights & Biases API key as a reference ('env:WANDB_API_KEY'), never the key.",
    )
