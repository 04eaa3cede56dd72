"""Can rollout write where it is told to? Checked before any work, for every writable URL.

A location on an object store (storage.artifacts = "s3://bucket/prefix", `rollout generate --out
gs://bucket/out.jsonl`) is checked in two stages:

1. its form, offline: a scheme fsspec knows, whose package is installed, and that other processes
   can see (memory:// is one process's, http:// is read-only);
2. over the wire: a small probe object is written under it and removed again. That proves at once
   that the endpoint answers, the bucket exists, and the credentials are accepted and may write,
   so a run cannot train for an hour and then fail at its first checkpoint.

Each failure is one Issue naming the key, the location, what went wrong and what to change
(rollout.planner.object_stores words them). `rollout validate` never comes here: it checks the
form of a config only, offline.
"""

from __future__ import annotations

import secrets

from rollout.errors import Issue
from rollout.files import is_url
from rollout.planner.locations import filesystem_package
from rollout.planner.object_stores import failure_issue, quick_filesystem, scheme

PROBE_PREFIX = ".rollout-probe-"
"""The probe object's name starts so: a leftover (the process killed between write and removal)
is recognisable as rollout's and harmless."""

# fsspec protocols that keep their files in one process's memory or are read-only: a run's
# workers (separate processes) would write files nobody else can read.
_NOT_SHARED = {
    "memory": "it lives in one process's memory",
    "http": "it is read-only",
    "https": "it is read-only",
    "github": "it is read-only",
    "zip": "it is read-only",
    "tar": "it is read-only",
}

_SUPPORTED = (
    "a local path, s3://bucket/prefix (pip install s3fs) or gs://bucket/prefix (pip install gcsfs)"
)


def form_issue(location: str, key: str, what: str) -> Issue | None:
    """Why `what` ("checkpoints") cannot be written to URL `location` as written, checked
    offline; None when the form is fine."""
    protocol = scheme(location)
    if protocol in _NOT_SHARED:
        return Issue(
            key,
            f"{what} cannot go to {protocol}:// ({_NOT_SHARED[protocol]})",
            value=location,
            hint=f"use {_SUPPORTED}",
        )
    from fsspec.registry import known_implementations

    if protocol not in known_implementations:
        return Issue(
            key,
            f"no fsspec filesystem is known for {protocol}://",
            value=location,
            hint=f"use {_SUPPORTED}",
        )
    package = filesystem_package(location)
    if package is not None:
        return Issue(
            key,
            f"writing to {protocol}:// needs the {package} package, which is not installed here",
            value=location,
            hint=f"pip install {package}",
        )
    return None


def writable_issue(location: str, key: str, what: str) -> Issue | None:
    """Why `what` cannot be written under directory URL `location` (its form, then a probe
    object written and removed over the wire); None when it can, and for local paths."""
    if not is_url(location):
        return None
    return form_issue(location, key, what) or _probe(location, key, what)


def _probe(location: str, key: str, what: str) -> Issue | None:
    doing = f"write {what} under"
    try:
        fs, base, bounded = quick_filesystem(location)
        probe = f"{base.rstrip('/')}/{PROBE_PREFIX}{secrets.token_hex(6)}"
        fs.pipe_file(probe, b"rollout write probe\n", **bounded)
        fs.rm_file(probe, **bounded)
    except Exception as error:  # every failure is classified and reported
        return failure_issue(error, location, key, doing=doing, writing=True)
    return None
