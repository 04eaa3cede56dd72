"""Models named by Hugging Face Hub id (`model.hub`), found in the local Hugging Face cache.

rollout never downloads: the planner resolves the id and revision to the commit and snapshot
directory the cache holds (huggingface_hub's own lookup, no network), the plan records both, the
worker loads from that directory, and a plan whose revision now points at another commit is stale.
huggingface_hub is imported by the functions that need it (it comes with transformers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class HubSnapshot:
    """What a Hub id and revision resolved to in the local cache."""

    commit: str
    directory: str


class NotCached(Exception):
    """The cache holds no snapshot for the id and revision; `reason` says what was looked for."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def cache_dir() -> str:
    """The Hugging Face hub cache, by huggingface_hub's own precedence (HF_HUB_CACHE, then
    HF_HOME/hub, then ~/.cache/huggingface/hub). huggingface_hub reads these once, when first
    imported; reading them at each call obeys a process (or test) that sets them later."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return os.path.expandvars(os.path.expanduser(explicit))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return os.path.join(os.path.expandvars(os.path.expanduser(home)), "hub")


def fetch_command(repo_id: str, revision: str) -> str:
    """The command that puts the model into the cache (the `hf` CLI of huggingface_hub)."""
    return f"hf download {repo_id} --revision {revision}"


def resolve(repo_id: str, revision: str) -> HubSnapshot:
    """The cached snapshot of `repo_id` at `revision` (a branch, tag or commit sha), without any
    network access. Raises NotCached if the cache lacks it, ImportError without huggingface_hub."""
    from huggingface_hub import errors, snapshot_download

    where = cache_dir()
    try:
        directory = snapshot_download(
            repo_id, revision=revision, cache_dir=where, local_files_only=True
        )
    except errors.LocalEntryNotFoundError as exc:
        # Newer huggingface_hub releases tell a partial download (its file listing is cached).
        incomplete = isinstance(exc, getattr(errors, "IncompleteSnapshotError", ()))
        raise NotCached(
            f"{repo_id} at revision {revision!r} is "
            + ("only partly downloaded into" if incomplete else "not in")
            + f" the Hugging Face cache {where}"
        ) from None
    # snapshots/<commit>: the directory's name is the commit the revision points at.
    directory = os.path.abspath(directory)
    return HubSnapshot(commit=os.path.basename(directory), directory=directory)
