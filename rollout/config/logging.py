"""[logging]: where metrics and logs go besides the run store."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from rollout.config.base import ConfigModel
from rollout.config.rewards import check_plugin_ref
from rollout.config.secrets import Location, SecretRef

Tracker = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]
BUILTIN_TRACKERS: tuple[str, ...] = Tracker.__args__  # type: ignore[attr-defined]


def check_tracker(value: str) -> str:
    """A built-in tracker's name, or a tracker plugin's reference (resolved at plan). A bare name
    close to a built-in's is taken for a typo of it, not for an entry point's name."""
    if value in BUILTIN_TRACKERS:
        return value
    check_plugin_ref(value)
    if ":" not in value:
        from rollout.config.translate import did_you_mean_choice

        if (hint := did_you_mean_choice(value, list(BUILTIN_TRACKERS))) is not None:
            raise ValueError(f"no tracker {value!r}; {hint}")
    return value


TrackerRef = Annotated[
    str,
    AfterValidator(check_tracker),
    Field(examples=[*BUILTIN_TRACKERS, "my_pkg.trackers:make", "./tracker.py:make"]),
]

TRACKER_OPTIONS: dict[str, tuple[str, ...]] = {
    "wandb": ("wandb_project", "wandb_api_key"),
    "mlflow": ("mlflow_tracking_uri", "mlflow_experiment"),
}
"""The [logging] keys that only one tracker reads: set without that tracker, they are refused."""

METRICS_OPTIONS = ("metrics_host", "metrics_key")
"""The [logging] keys that only the run host's /metrics server reads: refused without
metrics_port."""


class LoggingSection(ConfigModel):
    trackers: list[TrackerRef] = Field(
        default_factory=lambda: ["console"],
        description="Metric sinks besides the run store (which always records): console (progress "
        "bar and summary), jsonl (metrics.jsonl in the run directory), tensorboard (event files "
        "in <run_dir>/tensorboard; needs rollout[tensorboard]), wandb (Weights & Biases; needs "
        "rollout[wandb]), mlflow (needs rollout[mlflow]), or a tracker plugin: "
        "'package.module:factory', './file.py:factory' or an entry point in the "
        "'rollout.trackers' group, called as factory(run_id=..., run_dir=...) for an object with "
        "log(rows) and close(). See docs/trackers.md.",
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
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Serve Prometheus /metrics from the run's host process (node 0) on this "
        "port while the run goes: step, step time, tokens/s, reward, loss, queue depths, "
        "restarts, errors, read from what the workers write to the run store. 0 picks a free "
        "port (printed at start). None: no metrics server. See docs/observability.md.",
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="Address the /metrics server binds (metrics_port only). Anything but a "
        "loopback address needs metrics_key.",
    )
    metrics_key: SecretRef | None = Field(
        default=None,
        description="Key a scraper must send as 'Authorization: Bearer <key>' to /metrics, as a "
        "reference ('env:NAME' or 'file:/path'), never the key; read by the host at run start "
        "(metrics_port only). Required when metrics_host is not loopback.",
    )
    otlp_endpoint: Location | None = Field(
        default=None,
        min_length=1,
        description="Export OpenTelemetry traces (spans for plan, the workers' step phases "
        "generate/score/train/sync/checkpoint) over OTLP/HTTP to this collector URL, e.g. "
        "'http://127.0.0.1:4318/v1/traces'. Needs rollout[otel] (refused at plan without it). "
        "None: no tracing, and the OpenTelemetry packages are never imported.",
    )
