"""Plan-time check of a Postgres run store: it answers, and rollout can keep its tables there.

`run` opens the store before it launches anything and would stop there; `plan` says so first,
naming where the DSN points (database, host, port, user), never the rest of what it holds. The
check changes nothing: the tables are created by the run, and the probe's CREATE is rolled back.
(That psycopg is installed at all is a refusal both make: rollout/planner/runnable.py.)
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from rollout.config.root import RunConfig
from rollout.errors import Issue
from rollout.files import read_secret
from rollout.redact import redact_text

if TYPE_CHECKING:
    import psycopg

KEY = "storage.postgres_dsn"
CONNECT_TIMEOUT_S = 5


def store_issues(config: RunConfig) -> list[Issue]:
    reference = config.storage.postgres_dsn
    if (
        config.storage.backend != "postgres"
        or reference is None  # the config's own rule says so
        or importlib.util.find_spec("psycopg") is None  # runnable's refusal says so
    ):
        return []
    try:
        dsn = read_secret(reference)
    except (ValueError, OSError) as error:
        hint = (
            f"export {reference.removeprefix('env:')}='host=... dbname=... user=...' before "
            "planning (and running)"
            if reference.startswith("env:")
            else "write the DSN into that file"
        )
        return [Issue(KEY, f"cannot read the DSN: {error}", value=reference, hint=hint)]

    import psycopg
    from psycopg import conninfo

    try:
        params = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:  # its message quotes the DSN: not repeated
        return [
            Issue(
                KEY,
                "the DSN it names is not a libpq connection string ('host=... dbname=... "
                "user=...') or a postgresql:// URL",
                value=reference,
            )
        ]
    where = (
        f"database {params.get('dbname') or params.get('user') or '(default)'} on "
        f"{params.get('host') or 'the local socket'}:{params.get('port') or 5432}"
    )
    try:
        with psycopg.connect(dsn, connect_timeout=CONNECT_TIMEOUT_S, autocommit=True) as conn:
            refusal = _cannot_create(conn)
    except psycopg.Error as error:
        return [
            Issue(
                KEY,
                f"the postgres run store does not answer ({where}): {_first_line(error)}",
                value=reference,
                hint="start the server, or correct the DSN this reference names",
            )
        ]
    if refusal is not None:
        return [
            Issue(
                KEY,
                f"rollout cannot create its tables in {where}: {refusal}",
                value=reference,
                hint="grant the DSN's user CREATE on the schema its search_path names first, "
                "or name a schema it owns (options='-csearch_path=rollout')",
            )
        ]
    return []


def _cannot_create(conn: psycopg.Connection) -> str | None:
    """Why the run's first open could not create the store's tables here, or None."""
    import psycopg

    with conn.transaction(force_rollback=True):
        present = conn.execute("SELECT to_regclass('schema_version') IS NOT NULL").fetchone()
        if present and present[0]:
            return None  # a store is here: the run adds what migrations it lacks
        try:
            with conn.transaction():
                conn.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY)")
        except psycopg.Error as error:
            return _first_line(error)
    return None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return redact_text(lines[0] if lines else type(error).__name__)
