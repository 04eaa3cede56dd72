"""The run store: runs, metrics, logs and checkpoints, written by workers and read by the CLI.

A store is named by a location string: ``sqlite:/abs/path/rollout.db`` (the embedded default) or
``postgres:env:NAME`` / ``postgres:file:/path`` (for runs whose processes live on several
machines): a Postgres store is named by a reference to its DSN, never the DSN, so no location
(in a plan, a command line, a message) holds a password. Backends are imported only when a
location names them.
"""

from __future__ import annotations

import difflib
import os
import re
import sqlite3
from pathlib import Path

from rollout.errors import Issue, RolloutError
from rollout.files import SECRET_REF, read_secret
from rollout.storage.base import RunRecord, RunStore

STORE_ENV = "ROLLOUT_STORE"
# The config's default: run.output_dir = "runs", and the store file inside it.
DEFAULT_SQLITE_PATH = Path("runs", "rollout.db")

_PATH_LIKE = re.compile(r"[/\\\s]|\.\.")


def open_store(location: str, *, create: bool = True) -> RunStore:
    """Open the store at `location`. create=False (readers): a missing store is an error."""
    scheme, _, rest = location.partition(":")
    if scheme == "sqlite" and rest:
        return _open_sqlite(Path(rest).expanduser().resolve(), create=create)
    if scheme in ("postgres", "postgresql"):
        return _open_postgres(location, rest, create=create)
    if rest and scheme != "sqlite":
        message = f"unknown run store scheme {scheme!r}"  # only the scheme: the rest may be secret
    else:
        message = f"{location!r} is not a run store location"
    raise RolloutError(
        Issue("run store", message, hint="use sqlite:/path/to/rollout.db or postgres:env:NAME")
    )


def _open_postgres(location: str, reference: str, *, create: bool) -> RunStore:
    if not location.startswith("postgres:") or not SECRET_REF.match(reference):
        # Not echoed: it may be the DSN itself, password and all.
        raise RolloutError(
            Issue(
                "run store",
                "a postgres run store is named postgres:env:NAME or postgres:file:/path: a "
                "reference to its DSN, never the DSN itself",
                hint="export ROLLOUT_PG_DSN='host=... dbname=... user=...' and pass "
                "postgres:env:ROLLOUT_PG_DSN (or postgres:file:/path/to/dsn)",
            )
        )
    try:
        from rollout.storage.postgres import PostgresRunStore
    except ImportError:
        raise RolloutError(
            Issue(
                location,
                "the postgres run store needs psycopg 3, which is not installed here",
                hint="pip install 'rollout[postgres]' (or: pip install 'psycopg[binary]>=3.1')",
            )
        ) from None
    try:
        dsn = read_secret(reference)
    except (ValueError, OSError) as error:
        raise RolloutError(
            Issue(
                location,
                f"cannot read the DSN: {error}",
                hint=f"set it, e.g. export {reference.removeprefix('env:')}="
                "'host=127.0.0.1 dbname=rollout user=rollout'"
                if reference.startswith("env:")
                else "write the DSN into that file",
            )
        ) from None
    return PostgresRunStore(dsn, location=location, create=create)


def _open_sqlite(path: Path, *, create: bool) -> RunStore:
    from rollout.storage.sqlite import SqliteRunStore

    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    elif not path.is_file():
        raise RolloutError(
            Issue(
                str(path),
                "no run store here (the file does not exist)",
                hint=f"pass --store sqlite:/path/to/rollout.db or set {STORE_ENV}; a run "
                "creates its store when it starts",
            )
        )
    try:
        return SqliteRunStore(path, create=create)
    except sqlite3.DatabaseError as error:
        raise RolloutError(Issue(str(path), f"cannot open the run store: {error}")) from None


def default_store_location() -> str:
    """$ROLLOUT_STORE if set, else the config's default store under the current directory."""
    return os.environ.get(STORE_ENV) or f"sqlite:{DEFAULT_SQLITE_PATH.resolve()}"


def check_run_id(run_id: str) -> None:
    """Refuse an id that looks like a path (ids name run directories) before any store is read."""
    if not run_id or _PATH_LIKE.search(run_id):
        raise RolloutError(
            Issue(
                "run id",
                "a run id has no '/', '\\', '..' or whitespace",
                value=run_id,
                hint="copy the id from `rollout runs list`",
            )
        )


def find_run(store: RunStore, run_id: str, location: str) -> RunRecord:
    """The run, or a RolloutError that suggests the ids it may have meant."""
    record = store.get_run(run_id)
    if record is not None:
        return record
    known = [run.run_id for run in store.list_runs(limit=1000)]
    close = difflib.get_close_matches(run_id, known, n=3, cutoff=0.6)
    if close:
        hint = "did you mean " + " or ".join(repr(c) for c in close) + "?"
    elif known:
        hint = "`rollout runs list` shows the runs in this store"
    else:
        hint = "this store has no runs yet"
    raise RolloutError(Issue("run id", f"no run {run_id!r} in {location}", hint=hint))
