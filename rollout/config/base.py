"""Shared base for config models: strict, immutable, every field documented."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigModel(BaseModel):
    """Base of every config area.

    extra="forbid" turns a misspelled key into an error (with "did you mean"), frozen=True keeps a
    validated config from being changed behind the plan's back, validate_default checks our own
    defaults against the same rules as user values, and allow_inf_nan=False refuses TOML's nan/inf.

    Types are checked strictly where user input comes in (config/validate.py validates in
    pydantic's strict JSON mode: "20" is not 20), not here: models built in code, and a plan.lock
    read back from JSON (lists where the config has tuples), validate as they always have.
    """

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        validate_default=True,
        allow_inf_nan=False,  # TOML allows nan and inf; no setting of ours means either
    )
