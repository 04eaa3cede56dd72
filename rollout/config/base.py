"""Shared base for config models: strict, immutable, every field documented."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigModel(BaseModel):
    """Base of every config area.

    extra="forbid" turns a misspelled key into an error (with "did you mean"), frozen=True keeps a
    validated config from being changed behind the plan's back, validate_default checks our own
    defaults against the same rules as user values, and allow_inf_nan=False refuses TOML's nan/inf.
    """

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        validate_default=True,
        allow_inf_nan=False,  # TOML allows nan and inf; no setting of ours means either
    )
