"""`rollout generate --out s3://bucket/out.jsonl` (or gs://): staged locally, published whole.

An object store has no append, no fsync and no truncate, which resuming needs (output.py). So
the job writes, and resumes, a local staging copy under the cache (one per URL), and uploads it
once every prompt is done. An object appears only when its upload completes (S3 and GCS publish
a PUT, multipart and resumable uploads included, atomically), so an interrupted or failed job
never leaves a partial object at the URL that looks complete. A finished job whose upload failed
keeps its staging copy: the same command again uploads it without generating.

The URL is checked before any model loads: its form, then a probe object written and removed
beside it (rollout.planner.location_check), so a wrong bucket or missing credentials cost seconds.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from rollout.errors import Issue, RolloutError
from rollout.models.cache import cache_root
from rollout.planner.location_check import writable_issue
from rollout.planner.object_stores import failure_issue, quick_filesystem

OPTION = "--out"


def staging_path(url: str) -> Path:
    """The local file a job for `url` writes and resumes: the same for every run of it."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    digest = hashlib.sha256(url.encode("utf-8")).hexdigest()[:16]
    return cache_root() / "generate" / digest / name


def check_target(url: str, *, overwrite: bool, resuming: bool) -> None:
    """RolloutError when `url` cannot take the output: the store cannot be written beside it,
    or something that this job did not write is there already (without --overwrite)."""
    parent = url.rstrip("/").rsplit("/", 1)[0]
    issue = writable_issue(parent, OPTION, "the output")
    if issue is not None:
        raise RolloutError(Issue(OPTION, issue.message, value=url, hint=issue.hint))
    if not overwrite and not resuming and exists(url):
        raise RolloutError(
            Issue(
                OPTION,
                f"{url} already exists and is not the output of an interrupted "
                "`rollout generate` from this machine",
                hint="pass --overwrite to replace it, or choose another --out",
            )
        )


def exists(url: str) -> bool:
    try:
        fs, path, bounded = quick_filesystem(url)
        return bool(fs.exists(path, **bounded))
    except Exception as error:  # classified: unreachable, credentials, access, silence
        raise RolloutError(failure_issue(error, url, OPTION, doing="read", writing=False)) from None


def upload(staging: Path, url: str) -> None:
    """Publish the finished `staging` file at `url` in one upload."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
        fs.put_file(str(staging), path)
    except Exception as error:  # classified; the staging copy stays for the next attempt
        issue = failure_issue(error, url, OPTION, doing="upload the output to", writing=True)
        raise RolloutError(
            Issue(
                OPTION,
                issue.message,
                value=url,
                hint=f"{issue.hint}; every prompt is done and kept in {staging}: run the same "
                "command again to upload it",
            )
        ) from None
