"""[snapshot]: what `rollout snapshot save` captures besides the newest checkpoint."""

from __future__ import annotations

from pydantic import Field

from rollout.config.base import ConfigModel


class SnapshotSection(ConfigModel):
    process: bool = Field(
        default=False,
        description="Also dump the live worker processes with CRIU when `rollout snapshot save` "
        "snapshots a running run (their memory, open files and TCP connections, left running), "
        "so they can be restored where they stopped. Needs a host where `criu check` passes "
        "(root or CAP_CHECKPOINT_RESTORE, a kernel and vDSO CRIU supports); `rollout plan` "
        "refuses it elsewhere. Checkpoints are snapshotted either way.",
    )
