"""Plugins: resolving references (module:fn, ./file.py:fn, entry points) and noticing changes."""

from rollout.plugins.identity import PluginIdentity, installed_version, plugin_changes
from rollout.plugins.resolve import ResolvedPlugin, resolve_plugin

__all__ = [
    "PluginIdentity",
    "ResolvedPlugin",
    "installed_version",
    "plugin_changes",
    "resolve_plugin",
]
