"""What `rollout plugins` does, below the CLI: list the plugins a config could name, try one on a
sample (plugin_trial.py), scaffold a new one (rollout.plugins.scaffold). Kinds and their groups
are rollout.plugins.registry's."""

from __future__ import annotations

import json
from typing import Any

from rollout.errors import Issue, RolloutError
from rollout.inference.plugin_trial import Call, Trial, try_plugin
from rollout.plugins.registry import KINDS, Available, available
from rollout.plugins.scaffold import SCAFFOLD_KINDS, write_scaffold

__all__ = [
    "KINDS",
    "SCAFFOLD_KINDS",
    "Available",
    "Call",
    "Trial",
    "list_plugins",
    "reload_server",
    "try_plugin",
    "write_scaffold",
]


def list_plugins(kind: str | None = None) -> list[Available]:
    """Built-ins and installed entry points, of one kind or all; RolloutError for an unknown kind."""
    if kind is not None and kind not in KINDS:
        raise RolloutError(
            Issue(
                "--kind", f"no plugin kind {kind!r}", value=kind, hint=f"one of: {', '.join(KINDS)}"
            )
        )
    return available([kind] if kind is not None else None)


RELOAD_ROUTE = "/admin/reload"
RELOAD_TIMEOUT_S = 600.0
"""The swap waits for the requests in flight to finish on the old engine."""


def reload_server(url: str, api_key: str | None) -> dict[str, Any]:
    """POST a `rollout serve --dev` server's reload route: its answer (the engine, its old and
    new identity), or a RolloutError saying why it did not reload."""
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    from rollout.serve.loading import resolve_api_key

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RolloutError(
            Issue("--url", "is not an http(s) URL", value=url, hint="e.g. http://127.0.0.1:8000")
        )
    # The key reference is read as serve reads it; the loopback host only waives requiring one.
    key = resolve_api_key(api_key, "127.0.0.1") if api_key is not None else None
    target = url.rstrip("/").removesuffix("/v1") + RELOAD_ROUTE
    request = urllib.request.Request(target, data=b"{}", method="POST")
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=RELOAD_TIMEOUT_S) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise _refused(error.code, _error_message(error), url) from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise RolloutError(
            Issue(
                "--url",
                f"no server answered at {url}: {reason}",
                hint="start one with `rollout serve --dev --engine ./engine.py:make`, or pass its "
                "--url",
            )
        ) from None


def _error_message(error: Any) -> str:
    try:
        return str(json.loads(error.read())["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {error.code}"


def _refused(status: int, message: str, url: str) -> RolloutError:
    if status == 401:
        return RolloutError(
            Issue("--api-key", message, hint="pass the server's key: --api-key env:NAME")
        )
    if status == 403:
        return RolloutError(
            Issue(
                "--url",
                message,
                hint="restart the server with `rollout serve --dev ...`; a training run never "
                "reloads (its plugins are frozen by plan.lock: edit, then plan again)",
            )
        )
    if status == 404:
        return RolloutError(
            Issue("--url", f"{url} has no reload route ({message})", hint="is it `rollout serve`?")
        )
    return RolloutError(Issue("--url", message))
