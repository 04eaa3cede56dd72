"""A sidecar's health check at plan time: start it, hear its hello, ping it, stop it.

What would stop the worker's sidecar at step 1 (an interpreter that is not there or lacks
rollout, a child that never says hello or speaks another protocol version, one that writes
garbage to stdout) stops `rollout plan` instead, as one Issue naming the plugin.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rollout.config.environment import EnvironmentSection
from rollout.config.rewards import RewardSpec
from rollout.errors import Issue
from rollout.plugins.identity import PluginIdentity
from rollout.plugins.sidecar.host import SidecarError, SidecarHost, server_argv

START_TIMEOUT_S = 60.0


def sidecar_python(python: str | None, where: str, base: Path) -> tuple[str | None, Issue | None]:
    """The interpreter `python` (the config's, at `where`) names, as an absolute path (None:
    rollout's own). A path with a slash is relative to the config's directory; a bare name is
    looked up on PATH."""
    if python is None:
        return None, None
    found = str((base / python).absolute()) if "/" in python else shutil.which(python)
    if found is None or not Path(found).is_file():
        return None, Issue(
            where,
            "no such interpreter" + (" on PATH" if "/" not in python else f" (looked for {found})"),
            value=python,
            hint="give the path of a Python that has rollout and the plugin installed, "
            "e.g. /opt/venvs/judge/bin/python (relative paths start at the config's directory)",
        )
    return found, None


def health_check(host: SidecarHost, where: str) -> list[Issue]:
    """Start the sidecar as the worker will, hear its hello, ping it, stop it."""
    try:
        host.start()
        host.ping()
    except SidecarError as error:
        return [
            Issue(
                where,
                f"the health check of the sidecar failed: {error}",
                value="sidecar",
                hint="run the plugin in the worker (isolation = 'in_process') or fix what the "
                "sidecar's stderr says; see docs/sidecar.md",
            )
        ]
    finally:
        host.close()
    return []


def sidecar_issues(
    spec: RewardSpec, index: int, identity: PluginIdentity, python: str | None
) -> list[Issue]:
    """The health check of a reward's sidecar."""
    assert spec.fn is not None
    host = SidecarHost(
        server_argv(python, spec.fn, identity.model_dump_json()),
        name=spec.metric_name,
        start_timeout_s=START_TIMEOUT_S,
        echo_stderr=False,  # the error quotes its last lines; a passing check stays quiet
    )
    return health_check(host, f"rewards[{index}].isolation")


def environment_sidecar_issues(
    spec: EnvironmentSection, identity: PluginIdentity, python: str | None
) -> list[Issue]:
    """The health check of the environment's sidecar, built with its options as the worker's."""
    host = SidecarHost(
        server_argv(python, spec.name, identity.model_dump_json(), build=spec.options),
        name=spec.name,
        start_timeout_s=START_TIMEOUT_S,
        echo_stderr=False,
    )
    return health_check(host, "environment.isolation")
