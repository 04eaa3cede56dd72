"""The JSON Schema of a run config, generated from the pydantic models (the one source of truth)."""

from __future__ import annotations

import json
from typing import Any

from rollout.config.root import RunConfig

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_ID = "https://rollout.dev/schemas/rollout.schema.json"
TITLE = "rollout run config"
DESCRIPTION = (
    "One rollout run (run.toml): model, data, algorithm, generation, rewards, cluster, storage, "
    "checkpoint and logging. Generated from rollout.config by `rollout schema`; do not edit."
)


def build_schema() -> dict[str, Any]:
    """RunConfig's JSON Schema, with the identity keys first and the definitions last.

    Key order is only for readers of the committed file (properties before the definitions they
    refer to); pydantic already emits properties in field order and definitions sorted by name.
    """
    generated = RunConfig.model_json_schema()
    definitions = generated.pop("$defs")
    generated.pop("title")
    generated.pop("description")
    return {
        "$schema": SCHEMA_DIALECT,
        "$id": SCHEMA_ID,
        "title": TITLE,
        "description": DESCRIPTION,
        **generated,
        "$defs": definitions,
    }


def schema_text() -> str:
    """The schema as committed: 2-space JSON, UTF-8 text kept readable, one trailing newline."""
    return json.dumps(build_schema(), indent=2, ensure_ascii=False) + "\n"


def sidecar_schema_text() -> str:
    """The sidecar protocol's messages (rollout.plugins.sidecar.protocol), formatted the same way:
    what a sidecar in another language is written against."""
    from rollout.plugins.sidecar.protocol import protocol_schema

    return json.dumps(protocol_schema(), indent=2, ensure_ascii=False) + "\n"
