"""Sidecar plugins: a plugin in a process of its own, spoken to over a versioned protocol.

protocol.py: the messages and their framing; server.py: the child (`python -m
rollout.plugins.sidecar.server`); host.py: the parent, which starts, calls, times out, restarts
and stops the child. See docs/sidecar.md.
"""
