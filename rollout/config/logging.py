"""[logging]: where metrics and logs go besides the run store."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollout.config.base import ConfigModel
from rollout.config.secrets import Location, SecretRef

Tracker = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]

TRACKER_OPTIONS: dict[str, tuple[str, ...]] = {
    "wandb": ("wandb_project", "wandb_api_key"),
    "mlflow": ("mlflow_tracking_uri", "mlflow_experiment"),
}
"""The [logging] keys that only one tracker reads: set without that tracker, they are refused."""


class LoggingSection(ConfigModel):
    trackers: list[Tracker] = Field(
        default_factory=lambda: ["console"],
        description="Metric sinks besides the run store (which always records): console (progress "
        "bar and summary), jsonl (metrics.jsonl in the run directory), tensorboard (event files "
        "in <run_dir>/tensorboard; needs rollout[tensorboard]), wandb (Weights & Biases; needs "
        "rollout[wandb]), mlflow (needs rollout[mlflow]). See docs/trackers.md.",
    )
    level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Lowest log level recorded."
    )
    interval: int = Field(
        default=1,
        ge=1,
        description="Record training-step metrics every this many steps (and always the last "
        "step, evaluation steps and checkpoint steps); evaluation metrics are always recorded.",
    )
    samples_per_step: int = Field(
        default=4,
        ge=0,
        le=1024,
        description="Online runs: record this many sample completions (prompt, completion or a "
        "multi-turn episode's turns, reward) of each recorded training step in the run store, "
        "for `rollout report`'s trajectory viewer; the first ones of the step's batch on the "
        "first learner's actor. 0: none. Offline runs (sft, dpo, ...) sample nothing: leave it "
        "unset. See docs/reports.md.",
    )
    wandb_project: str | None = Field(
        default=None, min_length=1, description="Weights & Biases project (wandb tracker only)."
    )
    wandb_api_key: SecretRef | None = Field(
        default=None,
        description="Weights & Biases API key as a reference ('env:WANDB_API_KEY' or "
        "'file:/path'), never the key; read by the worker at run time (wandb tracker only). None: "
        "wandb's own login (WANDB_API_KEY, ~/.netrc).",
    )
    mlflow_tracking_uri: Location | None = Field(
        default=None,
        min_length=1,
        description="MLflow tracking URI (mlflow tracker only): a server (http://host:5000, "
        "https://..., databricks) or a local file store (file:///abs/path, or a path relative to "
        "the config file). None: the file store <run_dir>/mlruns.",
    )
    mlflow_experiment: str | None = Field(
        default=None,
        min_length=1,
        description="MLflow experiment name, created when missing (mlflow tracker only). None: "
        "the run name (run.name).",
    )
