"""[storage]: where run records (the run store) and artifacts (checkpoints) go."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollout.config.base import ConfigModel
from rollout.config.secrets import LocalPath, Location, SecretRef


class StorageSection(ConfigModel):
    backend: Literal["sqlite", "postgres"] = Field(
        default="sqlite",
        description="Run store: 'sqlite' (embedded, one file) or 'postgres' (one database for runs "
        "whose workers live on several machines; pip install 'rollout[postgres]').",
    )
    sqlite_path: LocalPath | None = Field(
        default=None,
        min_length=1,
        description="SQLite run-store file. None: <run.output_dir>/rollout.db.",
    )
    postgres_dsn: SecretRef | None = Field(
        default=None,
        description="Postgres DSN, as a reference only ('env:ROLLOUT_PG_DSN' or 'file:/path'), "
        "never the DSN itself. The DSN is libpq's 'host=... dbname=... user=...' or a "
        "postgresql:// URL; options='-csearch_path=SCHEMA' picks the schema. Required when "
        "backend is 'postgres'.",
    )
    artifacts: Location | None = Field(
        default=None,
        description="Where checkpoints go: a local path, file://, s3://bucket/prefix or "
        "gs://bucket/prefix; each run writes under <artifacts>/<run id>. None: inside the run "
        "directory.",
    )
