"""Config models (pydantic only, no torch) and loading. See root.RunConfig for the whole tree."""

from rollout.config.load import apply_overrides, load_config, read_config_file
from rollout.config.root import RunConfig
from rollout.config.validate import validate_config

__all__ = ["RunConfig", "apply_overrides", "load_config", "read_config_file", "validate_config"]
