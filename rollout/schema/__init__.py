"""Artifacts generated from the config models: JSON Schema, type stubs, Markdown reference.

The models in rollout.config are the one source of truth; `rollout schema` writes these files and
`rollout schema --check` (run in CI) fails when a committed one no longer matches.
"""

from rollout.schema.artifacts import (
    PATHS,
    artifact_text,
    generated_files,
    stale_files,
    write_files,
)
from rollout.schema.jsonschema import build_schema, schema_text
from rollout.schema.reference import build_reference
from rollout.schema.stubs import build_stubs

__all__ = [
    "PATHS",
    "artifact_text",
    "build_reference",
    "build_schema",
    "build_stubs",
    "generated_files",
    "schema_text",
    "stale_files",
    "write_files",
]
