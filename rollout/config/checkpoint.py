"""[checkpoint]: how often the training state is saved and how many saves are kept."""

from __future__ import annotations

from pydantic import Field

from rollout.config.base import ConfigModel


class CheckpointSection(ConfigModel):
    interval: int = Field(
        default=50, ge=1, description="Save a checkpoint every this many steps (and at the end)."
    )
    keep_last: int = Field(
        default=3,
        ge=1,
        description="Keep this many most recent checkpoints; older ones are deleted.",
    )
    save_optimizer: bool = Field(
        default=True,
        description="Include optimizer and scheduler state (needed for exact resume; doubles size).",
    )
