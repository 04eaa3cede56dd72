"""Plugins: resolving references (module:fn, ./file.py:fn, entry points) and noticing changes."""

from rollout.plugins.identity import PluginIdentity, installed_version, plugin_changes
from rollout.plugins.resolve import ResolvedPlugin, check_reward_signature, resolve_plugin

__all__ = [
    "PluginIdentity",
    "ResolvedPlugin",
    "check_reward_signature",
    "installed_version",
    "plugin_changes",
    "resolve_plugin",
]
