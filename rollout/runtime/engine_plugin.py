"""An engine plugin's factory, loaded for build_engine from the identity the plan (or a command's
--engine) resolved its reference to."""

from __future__ import annotations

from rollout.engines.plugin import EnginePlugin
from rollout.plugins.identity import PluginIdentity


def load_engine_plugin(identity: PluginIdentity | None) -> EnginePlugin | None:
    """The factory `identity` names, without resolving it again (None for a built-in engine)."""
    if identity is None:
        return None
    from rollout.plugins.resolve import load_plugin

    return EnginePlugin(identity.ref, identity.used_by, load_plugin(identity))
